"""The semantic hit guard: refuse a near-duplicate whose difference is exactly what embeddings miss.

Sentence embeddings put "Is X safe?" and "Is X not safe?" at cosine 0.9+ (GPTCache issue #694),
and "flights from Paris to Rome" next to "flights from Rome to Paris". A hit is refused when the
two texts differ in any of:

- **numbers** (digits and number words, as multisets);
- **negations** (not, no, never, n't, without, ...: their count);
- **named entities** (capitalised words not opening a sentence, words with inner capitals or
  digits: as sets, lower-cased);
- **word order** when the words are the same (same multiset, different sequence);
- **one swapped content word** in otherwise identical wording ("Can dogs eat chocolate?" vs "Can
  cats eat chocolate?", "open" vs "closed", "start" vs "end"): one word is all that differs, and
  it carries the meaning. Swapping a function word ("How do I" / "How can I") is allowed.

Pure string work on two short texts (tens of microseconds); no model.
"""

from __future__ import annotations

import re
from collections import Counter

_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'\-\.]*[A-Za-z0-9]|[A-Za-z0-9]")
_NUMBER = re.compile(r"\d+(?:[.,:/]\d+)*")
_NEGATIONS = frozenset({"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere",
                        "cannot", "without", "non", "isnt", "arent", "wasnt", "werent", "dont", "doesnt",
                        "didnt", "cant", "couldnt", "wont", "wouldnt", "shouldnt", "hasnt", "havent",
                        "hadnt", "mustnt", "neednt", "aint", "false", "except", "unless"})
_NUMBER_WORDS = frozenset({"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                           "seventeen", "eighteen", "nineteen", "twenty", "thirty", "forty", "fifty",
                           "sixty", "seventy", "eighty", "ninety", "hundred", "thousand", "million",
                           "billion", "trillion", "first", "second", "third", "fourth", "fifth", "half",
                           "double", "triple", "once", "twice", "dozen"})
_ROLE_PREFIX = re.compile(r"^(?:system|user|assistant|developer|tool): ", re.MULTILINE)
_OPENERS = frozenset(".!?:\n\"'(")
_FUNCTION_WORDS = frozenset({"a", "an", "the", "do", "does", "did", "can", "could", "would", "will", "should",
                            "shall", "may", "might", "must", "is", "are", "was", "were", "be", "how", "what",
                            "which", "who", "please", "me", "my", "i", "you", "your", "we", "us", "our", "to",
                            "of", "in", "on", "for", "it", "that", "this", "there", "at", "by", "with", "and",
                            "or", "so", "just", "kindly", "whats", "what's"})
# Capitalised words that are not names (question words, pronouns, auxiliaries opening a clause).
_COMMON_CAPS = frozenset({"i", "i'm", "i've", "i'd", "i'll"})


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


def numbers(text: str) -> Counter:
    found = Counter(n.replace(",", "") for n in _NUMBER.findall(text))
    found.update(w for w in (w.lower() for w in _words(text)) if w in _NUMBER_WORDS)
    return found


def negations(text: str) -> int:
    return sum(1 for w in _words(text) if w.lower().replace("'", "") in _NEGATIONS or w.lower().endswith("n't"))


def entities(text: str) -> set[str]:
    out = set()
    for m in _WORD.finditer(text):
        w = m.group()
        if w.lower() in _COMMON_CAPS:
            continue
        if w.endswith("'s"):
            w = w[:-2]
        inner = any(c.isupper() for c in w[1:]) or (any(c.isdigit() for c in w) and any(c.isalpha() for c in w))
        before = text[:m.start()].rstrip(" \t")
        opens_sentence = not before or before[-1] in _OPENERS
        if inner or (w[0].isupper() and not opens_sentence):
            out.add(w.lower().rstrip("."))
    return out


def refusal(new: str, cached: str) -> str | None:
    """Why ``cached`` must not answer ``new`` although they embed close, or None."""
    new, cached = _ROLE_PREFIX.sub("", new), _ROLE_PREFIX.sub("", cached)
    if numbers(new) != numbers(cached):
        return "numbers"
    if negations(new) != negations(cached):
        return "negation"
    a = [w.lower() for w in _words(new)]
    b = [w.lower() for w in _words(cached)]
    if a != b and Counter(a) == Counter(b):
        return "word_order"
    if entities(new) != entities(cached):
        return "entities"
    if len(a) == len(b):
        diff = [(x, y) for x, y in zip(a, b) if x != y]
        if len(diff) == 1 and not (diff[0][0] in _FUNCTION_WORDS and diff[0][1] in _FUNCTION_WORDS):
            return "swapped_word"
    return None
