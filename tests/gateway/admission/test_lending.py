"""Places lent between gateway processes through the real Redis (``lending.PlaceLedger``)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

from usefulwork.gateway.admission.lending import FORGET_S, STALE_S, PlaceLedger


def test_processes_see_each_others_places_and_a_lender_learns_what_it_lent_until_it_is_given_back(redis_url):
    import redis.asyncio as aioredis

    prefix = f"uwtest:{uuid.uuid4().hex}"

    async def go():
        r = aioredis.Redis.from_url(redis_url)
        a, b, c = (PlaceLedger(r, prefix, 0.2, process_id=x) for x in ("a", "b", "c"))
        assert (await a.exchange("p", 105.0, Counter(), 100.0))[:2] == ([], 0)
        assert (await c.exchange("p", None, Counter(), 100.0))[:2] == ([(105.0, "a")], 0)  # (c has no place in sight)
        places, owed, *_ = await b.exchange("p", 103.0, Counter(), 100.1)
        assert places == [(105.0, "a")] and owed == 0  # (its own not offered to itself; c's none)
        assert (await a.exchange("p", 105.0, Counter(), 100.2))[0] == [(103.0, "b")]
        # b takes two of a's places and one of c's: each lender learns its own count
        await b.exchange("p", 103.0, Counter({"a": 2, "c": 1}), 100.3)
        assert (await a.exchange("p", 105.0, Counter(), 100.4))[1] == 2
        assert (await c.exchange("p", None, Counter(), 100.4))[1] == 1
        # b gives back a's two (its next requests ended): the fields go, a owes nothing
        await b.exchange("p", 103.0, Counter({"c": 1}), 100.5)
        assert (await a.exchange("p", 105.0, Counter(), 100.6))[1] == 0
        assert (await c.exchange("p", None, Counter(), 100.6))[1] == 1
        # a place published too long ago is not offered; a borrower gone silent holds nothing on loan
        places, owed, *_ = await c.exchange("p", None, Counter(), 100.5 + a.places_fresh_s() + 0.2)
        assert places == [] and owed == 1
        assert (await c.exchange("p", None, Counter(), 100.5 + STALE_S + 0.1))[1] == 0
        # long gone: a's and b's entries are deleted (restarts do not pile them up)
        await c.exchange("p", None, Counter(), 100.6 + FORGET_S + 1.0)
        assert await r.hkeys(f"{prefix}:places:p") == [b"c"] and await r.hkeys(f"{prefix}:loans:p") == []
        assert await r.hkeys(f"{prefix}:held:p") == [b"c"] and await r.hkeys(f"{prefix}:took:p") == [b"c"]
        keys = await r.keys(prefix + "*")
        if keys:
            await r.delete(*keys)
        await r.aclose()

    asyncio.run(go())


def test_processes_see_the_places_others_hold_for_retries_and_learn_which_of_theirs_were_taken(redis_url):
    """A process publishes the places it holds for retries due soon; another, reached by one of those
    retries, publishes that it took it; the holder reads that (only its own), and stale entries are not read."""
    import redis.asyncio as aioredis

    prefix = f"uwtest:{uuid.uuid4().hex}"
    big = 2**62 + 12345  # (keys are 63-bit hashes: they travel exactly)

    async def go():
        r = aioredis.Redis.from_url(redis_url)
        a, b, c = (PlaceLedger(r, prefix, 0.2, process_id=x) for x in ("a", "b", "c"))
        await a.exchange("p", None, Counter(), 100.0, held=[(big, 101.25, 99.5, 1), (7, 101.5, 99.6, 2)])
        x = await b.exchange("p", None, Counter(), 100.1)
        assert x.held == {big: (101.25, 99.5, 1, "a"), 7: (101.5, 99.6, 2, "a")} and x.taken == []
        await b.exchange("p", None, Counter({"a": 1}), 100.2, took=[(big, 101.25, "a"), (9, 102.0, "c")])
        x = await a.exchange("p", None, Counter(), 100.3, held=[(7, 101.5, 99.6, 2)])
        assert x.taken == [(big, 101.25)] and x.owed == 1 and x.held == {}
        assert (await c.exchange("p", None, Counter(), 100.3)).taken == [(9, 102.0)]
        assert (await c.exchange("p", None, Counter(), 100.3)).held == {7: (101.5, 99.6, 2, "a")}
        # published too long ago: neither offered nor read as taken
        x = await c.exchange("p", None, Counter(), 100.3 + a.places_fresh_s() + 0.1)
        assert x.held == {} and x.taken == []
        keys = await r.keys(prefix + "*")
        if keys:
            await r.delete(*keys)
        await r.aclose()

    asyncio.run(go())
