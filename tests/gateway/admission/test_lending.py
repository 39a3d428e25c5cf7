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
        assert await a.exchange("p", 105.0, Counter(), 100.0) == ([], 0)
        assert await c.exchange("p", None, Counter(), 100.0) == ([(105.0, "a")], 0)  # (c has no place in sight)
        places, owed = await b.exchange("p", 103.0, Counter(), 100.1)
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
        places, owed = await c.exchange("p", None, Counter(), 100.5 + a.places_fresh_s() + 0.2)
        assert places == [] and owed == 1
        assert (await c.exchange("p", None, Counter(), 100.5 + STALE_S + 0.1))[1] == 0
        # long gone: a's and b's entries are deleted (restarts do not pile them up)
        await c.exchange("p", None, Counter(), 100.6 + FORGET_S + 1.0)
        assert await r.hkeys(f"{prefix}:places:p") == [b"c"] and await r.hkeys(f"{prefix}:loans:p") == []
        keys = await r.keys(prefix + "*")
        if keys:
            await r.delete(*keys)
        await r.aclose()

    asyncio.run(go())
