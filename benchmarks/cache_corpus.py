"""A realistic corpus for the vector-index benchmark: 100k vectors grown from real question embeddings.

Random Gaussian vectors make HNSW look broken (recall 0.1: no structure to navigate), so the index
is measured on all-MiniLM-L6-v2 embeddings of question-like text: templates crossed with topics,
entities and details, which cluster the way real cache traffic does (many questions about the same
things, worded differently). Queries are drawn from the same generator with another seed, so their
nearest entries are similar but not identical questions.

Embedding 100k texts takes over two hours on the shared 2-core machine (about 12 texts/s under
load), so ``--real`` texts are embedded and the rest of the ``--n`` vectors are grown from them:
each is a real embedding plus a third of another real one from the same template, plus 3% noise,
renormalised: it keeps the clusters of real traffic (which is what HNSW navigates) and is clearly
NOT Gaussian. The queries are real embeddings of held-out questions.

    python benchmarks/cache_corpus.py --n 100000 --real 8000 --queries 1000 --out /tmp/uw-cache-corpus.npz
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEMPLATES = [
    "How do I {verb} a {thing} in {tool}?", "What is the best way to {verb} {thing}s with {tool}?",
    "Why does my {thing} fail to {verb} in {tool}?", "Can you explain how to {verb} a {thing} using {tool}?",
    "What is the {attr} of {place}?", "Tell me about the {attr} of {place}.", "Is {place} known for its {attr}?",
    "Compare the {attr} of {place} and {place2}.", "Write a short {form} about {topic}.",
    "Summarize the main ideas of {topic} in {n} sentences.", "Give me {n} tips for {activity}.",
    "What are common mistakes when {activity}?", "How long does it take to learn {activity}?",
    "Recommend {n} books about {topic}.", "Is it healthy to eat {food} every day?",
    "How many calories are in {n} {food}s?", "What should I cook with {food} and {food2}?",
    "My {thing} in {tool} throws an error when I {verb} it, what should I check?",
    "Translate '{phrase}' into {lang}.", "How do you say '{phrase}' in {lang}?",
]
WORDS = {
    "verb": ["sort", "reverse", "merge", "split", "parse", "serialize", "cache", "index", "copy", "delete",
             "rename", "compress", "encrypt", "validate", "profile", "debug", "deploy", "test", "format", "filter"],
    "thing": ["list", "dictionary", "string", "file", "table", "array", "dataframe", "branch", "container",
              "function", "class", "query", "request", "image", "matrix", "tensor", "socket", "thread", "log", "config"],
    "tool": ["Python", "JavaScript", "Rust", "Go", "Java", "SQL", "git", "Docker", "Kubernetes", "bash", "pandas",
             "numpy", "React", "C++", "TypeScript", "Excel", "PostgreSQL", "Redis", "Linux", "PyTorch"],
    "attr": ["population", "climate", "history", "cuisine", "economy", "capital", "language", "architecture",
             "geography", "culture", "currency", "time zone", "largest city", "national sport", "government"],
    "place": ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Peru", "Egypt", "Vietnam",
              "Australia", "Mexico", "Italy", "Germany", "Chile", "Morocco", "Iceland", "Thailand", "Poland", "Spain"],
    "form": ["poem", "story", "haiku", "essay", "song", "limerick", "dialogue", "speech"],
    "topic": ["climate change", "the French revolution", "quantum computing", "photosynthesis", "the stock market",
              "machine learning", "the Roman empire", "black holes", "vaccines", "jazz", "chess openings",
              "renewable energy", "the human brain", "cryptography", "ancient Egypt", "volcanoes", "democracy",
              "evolution", "the internet", "coffee"],
    "activity": ["running a marathon", "learning the piano", "public speaking", "baking bread", "gardening",
                 "investing", "writing a novel", "learning Spanish", "swimming", "woodworking", "meditation",
                 "photography", "rock climbing", "knitting", "cycling"],
    "food": ["banana", "egg", "apple", "avocado", "potato", "carrot", "salmon", "tofu", "lentil", "mushroom",
             "tomato", "almond", "oat", "spinach", "chicken breast"],
    "phrase": ["good morning", "thank you very much", "where is the station", "I am hungry", "see you tomorrow",
               "how much does it cost", "happy birthday", "I love you", "excuse me", "what time is it"],
    "lang": ["Spanish", "French", "German", "Japanese", "Italian", "Portuguese", "Korean", "Dutch", "Swedish", "Turkish"],
    "n": ["two", "three", "four", "five", "six", "seven", "ten", "2", "3", "5"],
}
WORDS["place2"], WORDS["food2"] = WORDS["place"], WORDS["food"]
SUFFIXES = ["", " Please be brief.", " Thanks!", " I'm a beginner.", " Keep it simple.", " Explain step by step.",
            " Answer in one paragraph.", " This is for a school project.", " I tried already but it did not work.",
            " Give an example."]


def questions(n: int, seed: int, exclude: set[str] | None = None) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    seen = set(exclude or ())
    while len(out) < n:
        t = rng.choice(TEMPLATES)
        text = t.format(**{k: rng.choice(v) for k, v in WORDS.items()}) + rng.choice(SUFFIXES)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--real", type=int, default=8000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--out", default="/tmp/uw-cache-corpus.npz")
    args = ap.parse_args()
    from usefulwork.embedding import Embedder  # noqa: PLC0415
    corpus = questions(args.real, seed=1)
    queries = questions(args.queries, seed=2, exclude=set(corpus))
    emb = Embedder(max_batch=64)
    t0 = time.perf_counter()
    real = emb.encode(["user: " + q for q in corpus])
    qv = emb.encode(["user: " + q for q in queries])
    print(f"embedded {len(corpus) + len(queries)} texts in {time.perf_counter() - t0:.0f} s", flush=True)
    rng = np.random.default_rng(3)
    grown = args.n - len(real)
    a = rng.integers(0, len(real), grown)
    b = rng.integers(0, len(real), grown)
    noise = rng.standard_normal((grown, real.shape[1])).astype(np.float32) * (0.03 / np.sqrt(real.shape[1]))
    extra = real[a] + real[b] / 3.0 + noise
    extra /= np.linalg.norm(extra, axis=1, keepdims=True)
    vecs = np.concatenate([real, extra.astype(np.float32)])
    np.savez(args.out, corpus=vecs, queries=qv)


if __name__ == "__main__":
    main()
