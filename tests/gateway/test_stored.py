"""The owners of stored Responses: this process's LRU (the Redis one is tested end to end in
tests/e2e/test_stored_responses.py)."""

from __future__ import annotations

from usefulwork.gateway.stored import LocalOwners, Owner


async def test_the_most_recently_made_or_used_ids_are_kept():
    owners = LocalOwners(max_ids=2)
    a, b = Owner("alice", "p", "http://r0"), Owner("bob", "p", "http://r1")
    owners.note("r-a", a)
    owners.note("r-b", b)
    assert await owners.owner("r-a") == a  # used: now the newest
    owners.note("r-c", a)
    assert await owners.owner("r-b") is None and await owners.owner("r-a") == a and await owners.owner("r-c") == a
    assert Owner.decode(a.encode()) == a and Owner.decode(b"not\tthree") is None
