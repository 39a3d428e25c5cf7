"""Writes usefulwork/routers/data/labeled_prompts.jsonl: the project's labeled routing set.

Prompts are composed from templates and topic lists written for this project (no external data):
``small`` = a small model answers it well (lookups, short rewrites, simple arithmetic, formatting,
even when the input text is long); ``large`` = it needs reasoning, planning, code or analysis (even
when the prompt is short). Deterministic (seed 0):  python scripts/labeled_prompts.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "India", "Egypt", "Chile", "Vietnam",
             "Poland", "Morocco", "Peru", "Sweden", "Ghana", "Turkey", "Mexico", "Spain", "Italy", "Nepal"]
WORDS = ["happy", "quick", "bright", "angry", "large", "quiet", "brave", "simple", "ancient", "fragile",
         "generous", "hollow", "eager", "calm", "rapid", "humble"]
LANGS = ["Spanish", "French", "German", "Italian", "Portuguese"]
PHRASES = ["good morning", "thank you very much", "where is the station", "see you tomorrow", "I am hungry",
           "the weather is nice", "how much does it cost"]
TECH = ["a hash map", "a mutex", "TCP", "DNS", "a B-tree", "garbage collection", "a CDN", "TLS", "a message queue",
        "an index in a database", "a load balancer", "HTTP caching", "a bloom filter", "consistent hashing",
        "a write-ahead log", "backpressure", "a circuit breaker", "vector clocks"]
SYSTEMS = ["a URL shortener", "a chat service for 10 million users", "a ride-sharing dispatch system",
           "a news feed", "a distributed rate limiter", "a metrics pipeline ingesting 1M points per second",
           "an online bookstore checkout", "a collaborative document editor", "a video transcoding service",
           "a multi-region key-value store", "a payment ledger", "a job scheduler with retries"]
LANGS_CODE = ["Python", "Go", "Rust", "TypeScript", "Java"]
TASKS_CODE = ["parses a CSV file and returns the average of a column, skipping malformed rows",
              "implements an LRU cache with O(1) get and put", "merges overlapping time intervals",
              "retries an HTTP call with exponential backoff and jitter", "validates an IPv4 address",
              "finds the k most frequent words in a text", "implements a token bucket rate limiter",
              "serializes a binary tree to a string and back", "deduplicates events arriving out of order",
              "computes the median of a stream of numbers", "walks a directory tree and sums file sizes by extension",
              "detects a cycle in a directed graph"]
TOPICS = ["remote work", "nuclear power", "electric cars", "microservices", "monorepos", "four-day work weeks",
          "open-source licensing", "universal basic income", "static typing", "carbon taxes", "NoSQL databases",
          "standing desks", "code reviews", "city bike lanes"]
PAIRS = [("PostgreSQL", "MySQL"), ("Kafka", "RabbitMQ"), ("REST", "gRPC"), ("React", "Vue"), ("AWS", "GCP"),
         ("leasing", "buying a car"), ("renting", "buying a home"), ("index funds", "individual stocks"),
         ("Kubernetes", "plain VMs"), ("SQLite", "PostgreSQL for a mobile app backend"), ("Rust", "C++")]
FILLER = ("The quarterly meeting covered the new office layout, the holiday schedule, and the parking rules. "
          "Everyone agreed that the kitchen should be cleaned on Fridays and that the printer on the third floor "
          "needs a new toner cartridge. The team lunch moves to Thursday. ")


def small(rng: random.Random) -> str:
    c = rng.choice(COUNTRIES)
    w = rng.choice(WORDS)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    t = rng.choice(TECH)
    options = [
        f"What is the capital of {c}?",
        f"Which continent is {c} in?",
        f"What currency does {c} use?",
        f"Give me a synonym for '{w}'.",
        f"What is the opposite of '{w}'?",
        f"Translate '{rng.choice(PHRASES)}' into {rng.choice(LANGS)}.",
        f"What is {a} plus {b}?",
        f"What is {a} times {b}?",
        f"Spell '{w}' backwards.",
        f"How many letters are in the word '{w}'?",
        f"What does the abbreviation {rng.choice(['HTTP', 'CPU', 'RAM', 'DNS', 'URL', 'SQL', 'API', 'GPU', 'NASA', 'FAQ'])} stand for?",
        f"In one sentence, what is {t}?",
        f"Convert {a} kilometers to miles.",
        f"Convert {a} degrees Celsius to Fahrenheit.",
        f"Is {a * b} an even number?",
        f"Write the word '{w}' in capital letters.",
        f"Name three animals that live in {rng.choice(['the ocean', 'the desert', 'the Arctic', 'rainforests'])}.",
        f"What day comes after {rng.choice(['Monday', 'Tuesday', 'Friday', 'Saturday'])}?",
        f"Fix the spelling in this sentence: 'I recieved teh package yesterday and it was definately late.'",
        f"Put these words in alphabetical order: {', '.join(rng.sample(WORDS, 4))}.",
        f"How many words are in this text? {FILLER * rng.randint(2, 5)}",
        f"Give this text a short title of at most five words: {FILLER * rng.randint(3, 6)}",
        f"Translate this sentence into {rng.choice(LANGS)}: 'The meeting moved to Thursday at ten.'",
        f"Reply with only yes or no: is {c} in Europe?",
        f"Extract every day of the week mentioned in this note: {FILLER * rng.randint(2, 4)}",
        f"Format this as a bulleted list: apples, bread, milk, {w} coffee beans, eggs.",
    ]
    return rng.choice(options)


def large(rng: random.Random) -> str:
    t = rng.choice(TECH)
    s = rng.choice(SYSTEMS)
    lang = rng.choice(LANGS_CODE)
    task = rng.choice(TASKS_CODE)
    topic = rng.choice(TOPICS)
    p, q = rng.choice(PAIRS)
    options = [
        f"Write a {lang} function that {task}. Include tests.",
        f"Implement in {lang}: a function that {task}, and explain its time complexity.",
        f"Design {s}. Cover the data model, the APIs, how it scales, and the failure modes.",
        f"Compare {p} and {q} for a team of ten engineers: cost, operations, performance and risks. Recommend one.",
        f"Analyze the arguments for and against {topic}, weigh the evidence, and give a reasoned conclusion.",
        f"Explain why {t} can become a bottleneck under heavy load, and how you would diagnose and fix it.",
        f"Prove that the square root of {rng.choice([2, 3, 5, 7])} is irrational.",
        f"A tank fills at {rng.randint(2, 9)} liters per minute and leaks at {rng.randint(1, 2)} liters per minute; "
        f"it holds {rng.randint(50, 300)} liters. Work out step by step how long it takes to fill, then how the "
        f"answer changes if the leak doubles after half the tank is full.",
        f"Our {s} has p99 latency spikes every night at 2am. Walk me through a systematic investigation plan.",
        f"Write a detailed migration plan from {p} to {q} with zero downtime, including rollback.",
        f"Critique this design: we store sessions in {t} and replicate them synchronously across three regions. "
        f"What breaks, and what would you change?",
        f"Write a {rng.randint(300, 600)}-word essay on {topic} with a clear thesis and counterarguments.",
        f"Debug this {lang} snippet and explain the bug: a loop appends closures that capture the loop variable, "
        f"and every closure returns the last value.",
        f"Derive the expected number of coin flips to see {rng.randint(2, 5)} heads in a row, showing each step.",
        f"Refactor a 2000-line {lang} module that mixes database access, business rules and HTTP handling into "
        f"clean layers. Describe the steps and show the key interfaces.",
        f"Explain how {t} works internally, then compare two alternative designs and their trade-offs.",
        f"Given monthly revenue that grew 4%, 7%, -2%, 11% and 3%, analyze the trend, compute the compound growth "
        f"and forecast the next quarter with stated assumptions.",
        f"Write a SQL query that finds, for each customer, the longest streak of consecutive days with an order, "
        f"and explain how it works.",
        f"Why does {t} matter for {s}? Which trade-offs does it force? What would you monitor?",
        f"Plan a {rng.randint(3, 8)}-week curriculum to learn {lang} for a data analyst, with weekly projects.",
        f"Solve: how many ways can {rng.randint(5, 9)} people sit around a round table if two of them refuse to "
        f"sit together? Explain the reasoning.",
        f"Summarize the trade-offs between {p} and {q}, then write a decision record for choosing between them.",
        f"Evaluate the security risks of {s} and propose mitigations ranked by impact.",
        f"Write a {lang} program that {task}, handle edge cases, and document the design decisions.",
    ]
    return rng.choice(options)


def main() -> None:
    rng = random.Random(0)
    rows, seen = [], set()
    for label, make in (("small", small), ("large", large)):
        n = 0
        while n < 330:
            text = make(rng)
            if text in seen:
                continue
            seen.add(text)
            rows.append({"prompt": text, "label": label})
            n += 1
    rng.shuffle(rows)
    out = Path(__file__).resolve().parent.parent / "usefulwork/routers/data/labeled_prompts.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
