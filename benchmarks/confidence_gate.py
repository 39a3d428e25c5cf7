"""How well the small tier's token logprobs separate right from wrong answers (issue 11).

    python benchmarks/confidence_gate.py --url http://127.0.0.1:8000 --model smollm2-135m-instruct [--json FILE]

Asks a real vLLM server (greedy, logprobs on) a labeled set of questions with checkable answers,
written for this project (capitals, arithmetic, common facts; an answer is right when it contains
one of the accepted strings). For each answer it takes the mean and the minimum token logprob, as
the confidence gate does, and reports:

- AUROC of each confidence signal for "the answer is right" (0.5 = no better than chance), over
  all questions and within each kind;
- at the same escalation rate (escalate the least confident X% of answers), how many wrong answers
  the gate catches versus random escalation (which catches X% of the wrong ones on average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time

import httpx
import numpy as np

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
            "Canada": "Ottawa", "Australia": "Canberra", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima",
            "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "Portugal": "Lisbon",
            "Russia": "Moscow", "China": "Beijing", "India": "New Delhi", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
            "Mexico": "Mexico City", "Chile": "Santiago", "Turkey": "Ankara", "Iran": "Tehran", "Thailand": "Bangkok",
            "Vietnam": "Hanoi", "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest", "Finland": "Helsinki",
            "Denmark": "Copenhagen", "Belgium": "Brussels", "Netherlands": "Amsterdam", "Switzerland": "Bern",
            "Morocco": "Rabat", "Nigeria": "Abuja", "Ghana": "Accra", "Colombia": "Bogota", "Cuba": "Havana",
            "South Korea": "Seoul"}
FACTS = [
    ("How many legs does a spider have?", ["8", "eight"]), ("How many days are in a week?", ["7", "seven"]),
    ("What color is the sky on a clear day?", ["blue"]), ("What is the freezing point of water in Celsius?", ["0", "zero"]),
    ("How many continents are there?", ["7", "seven"]), ("What planet do we live on?", ["earth"]),
    ("What is the largest planet in the solar system?", ["jupiter"]), ("What gas do plants absorb?", ["carbon dioxide", "co2"]),
    ("Who wrote 'Romeo and Juliet'?", ["shakespeare"]), ("What is the chemical symbol for gold?", ["au"]),
    ("How many hours are in a day?", ["24", "twenty-four"]), ("What is the boiling point of water in Celsius?", ["100"]),
    ("How many sides does a triangle have?", ["3", "three"]), ("How many sides does a hexagon have?", ["6", "six"]),
    ("What is the largest ocean on Earth?", ["pacific"]), ("What animal is known as the king of the jungle?", ["lion"]),
    ("Which planet is known as the Red Planet?", ["mars"]), ("What is the opposite of hot?", ["cold"]),
    ("How many months are in a year?", ["12", "twelve"]), ("What is the tallest mountain in the world?", ["everest"]),
    ("Who painted the Mona Lisa?", ["leonardo", "da vinci"]), ("What is the chemical symbol for water?", ["h2o"]),
    ("What language is spoken in Brazil?", ["portuguese"]), ("How many minutes are in an hour?", ["60", "sixty"]),
    ("What is the square root of 81?", ["9", "nine"]), ("Which metal is liquid at room temperature?", ["mercury"]),
    ("What is the smallest prime number?", ["2", "two"]), ("Who developed the theory of relativity?", ["einstein"]),
    ("How many strings does a standard guitar have?", ["6", "six"]), ("What is the currency of Japan?", ["yen"]),
    ("In which year did World War II end?", ["1945"]), ("What is the longest river in Africa?", ["nile"]),
    ("How many players are on a soccer team on the field?", ["11", "eleven"]), ("What is the hardest natural substance?", ["diamond"]),
    ("What is the main language spoken in Mexico?", ["spanish"]), ("How many bones are in the adult human body?", ["206"]),
    ("What is the chemical symbol for iron?", ["fe"]), ("Which organ pumps blood through the body?", ["heart"]),
    ("What is 10 squared?", ["100"]), ("How many zeros are in one million?", ["6", "six"]),
]


def questions(seed: int = 0) -> list[tuple[str, str, list[str]]]:
    """(kind, question, accepted answers)."""
    rng = random.Random(seed)
    out = [("capital", f"What is the capital of {c}? Answer with the city name only.",
            [a.lower(), a.lower().replace("i", "í")]) for c, a in CAPITALS.items()]
    for _ in range(20):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append(("arithmetic", f"What is {a} + {b}? Answer with the number only.", [str(a + b)]))
    for _ in range(20):
        a, b = rng.randint(3, 9), rng.randint(11, 29)
        out.append(("arithmetic", f"What is {a} times {b}? Answer with the number only.", [str(a * b)]))
    out += [("fact", q + " Answer briefly.", ans) for q, ans in FACTS]
    return out


def auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counting half."""
    pos, neg = scores[positive], scores[~positive]
    if not len(pos) or not len(neg):
        return float("nan")
    gt = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(gt / (len(pos) * len(neg)))


async def ask(client: httpx.AsyncClient, url: str, model: str, q: str, max_tokens: int) -> tuple[str, list[float]]:
    r = await client.post(f"{url}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
        "temperature": 0, "logprobs": True})
    r.raise_for_status()
    ch = r.json()["choices"][0]
    return ch["message"]["content"] or "", [t["logprob"] for t in ch["logprobs"]["content"]]


async def run(url: str, model: str, max_tokens: int, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(kind: str, q: str, accepted: list[str]) -> dict:
            async with sem:
                text, lps = await ask(client, url, model, q, max_tokens)
            low = text.lower()
            return {"kind": kind, "q": q, "answer": text, "right": any(a in low for a in accepted),
                    "mean_logprob": float(np.mean(lps)) if lps else -99.0, "min_logprob": float(min(lps)) if lps else -99.0}
        return await asyncio.gather(*(one(k, q, a) for k, q, a in questions()))


def report(rows: list[dict], rates: tuple[float, ...] = (0.2, 0.3, 0.5)) -> dict:
    right = np.array([r["right"] for r in rows])
    out: dict = {"questions": len(rows), "right": int(right.sum()), "wrong": int((~right).sum())}
    for sig in ("mean_logprob", "min_logprob"):
        s = np.array([r[sig] for r in rows])
        out[f"auroc_{sig}"] = round(auroc(s, right), 4)
        caught = {}
        order = np.argsort(s, kind="stable")  # least confident first
        for rate in rates:
            k = int(round(rate * len(rows)))
            esc = np.zeros(len(rows), dtype=bool)
            esc[order[:k]] = True
            gate = int((esc & ~right).sum())
            rand = rate * int((~right).sum())
            caught[f"{int(rate * 100)}%"] = {"escalated": k, "wrong_caught_gate": gate,
                                             "wrong_caught_random": round(rand, 1),
                                             "gain": round(gate / rand, 2) if rand else None}
        out[f"escalation_{sig}"] = caught
        # within each kind too: a signal that only told arithmetic from capitals would not be a gate
        kinds = sorted({r["kind"] for r in rows})
        k_arr = np.array([r["kind"] for r in rows])
        out[f"auroc_{sig}_by_kind"] = {k: round(auroc(s[k_arr == k], right[k_arr == k]), 4) for k in kinds}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    rows = asyncio.run(run(args.url.rstrip("/"), args.model, args.max_tokens, args.concurrency))
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "server": args.url, "model": args.model,
           "machine": f"{platform.machine()} shared 2-core VM", "seconds": round(time.time() - t0, 1), **report(rows)}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**res, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
