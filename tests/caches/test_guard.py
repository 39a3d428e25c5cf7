import pytest

from usefulwork.caches.guard import refusal


@pytest.mark.parametrize("new,cached,why", [
    ("Is it safe to eat raw eggs?", "Why is it not safe to eat raw eggs?", "negation"),
    ("Why isn't the sky blue?", "Why is the sky blue?", "negation"),
    ("What is 15 percent of 200?", "What is 25 percent of 200?", "numbers"),
    ("Book a table for two", "Book a table for four", "numbers"),
    ("Send the report to John", "Send the report to Mary", "entities"),
    ("Bob sent money to Alice.", "Alice sent money to Bob.", "word_order"),
    ("Can cats eat chocolate?", "Can dogs eat chocolate?", "swapped_word"),
])
def test_refuses(new, cached, why):
    assert refusal(new, cached) == why


@pytest.mark.parametrize("new,cached", [
    ("How can I reverse a Python list?", "How do I reverse a list in Python?"),
    ("What's France's capital city?", "What is the capital of France?"),
    ("What is 15% of 200?", "What is 15 percent of 200?"),
    ("user: How can I reset my password?", "user: How do I reset my password?"),
])
def test_allows_paraphrases(new, cached):
    assert refusal(new, cached) is None
