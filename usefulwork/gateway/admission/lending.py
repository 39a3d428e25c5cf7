"""Places lent between gateway processes through Redis (``PoolQueue._borrow``).

Behind a load balancer that sends each attempt to the next gateway process, a client's retry reaches another
process than the one whose slots priced its Retry-After, and the processes' slots free at different times.
Each process publishes, every ``interval_s``, when its next slot frees with nobody of its own to take it
(``PoolQueue.next_place``) and how many slots it runs on loan from each other process. A retry with no slot
near takes a place another process published within its budget; the lender reads how many of its slots
others hold on loan and leaves as many idle, until the borrower's next request ends and it gives one back.

What is published is absolute (a place, a count of loans), so a lost or repeated exchange settles at the
next one. A process whose entry is older than ``STALE_S`` is gone: its places are not offered and the loans
it held are void (a borrower that died frees its lenders' slots). Redis down: each process on its own slots.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

STALE_S = 3.0  # a process that has not published for this long is gone (its loans void)
FORGET_S = 60.0  # and after this long its entries are deleted


class PlaceLedger:
    def __init__(self, r: Any, prefix: str, interval_s: float = 0.2, process_id: str | None = None):
        self.r = r  # a redis.asyncio.Redis
        self.prefix = prefix
        self.interval_s = interval_s
        self.me = process_id or os.urandom(6).hex()
        self._fields: dict[str, set[str]] = {}  # pool -> the loan fields this process set last time

    def places_fresh_s(self) -> float:
        """How old a published place may be and still be offered: a few exchanges (places move within seconds)."""
        return max(0.5, 3.0 * self.interval_s)

    async def exchange(self, pool: str, next_at: float | None, loans: Counter[str], now: float
                       ) -> tuple[list[tuple[float, str]], int]:
        """Publish this process's next place (``next_at``, wall seconds; None: none in sight) and its loans per
        lender; return the other processes' places (wall seconds, process) and how many of
        this process's slots other live processes hold on loan. One pipeline."""
        places_key, loans_key = f"{self.prefix}:places:{pool}", f"{self.prefix}:loans:{pool}"
        fields = {f"{self.me}>{lender}": n for lender, n in loans.items() if n > 0}
        gone = self._fields.get(pool, set()) - set(fields)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(places_key, self.me, f"{'-' if next_at is None else repr(next_at)},{now!r}")
        if fields:
            pipe.hset(loans_key, mapping=fields)
        if gone:
            pipe.hdel(loans_key, *gone)
        pipe.expire(places_key, 3600)
        pipe.expire(loans_key, 3600)
        pipe.hgetall(places_key)
        pipe.hgetall(loans_key)
        res = await pipe.execute()
        self._fields[pool] = set(fields)
        live, places, dead = set(), [], []
        for k, v in res[-2].items():
            pid, (at, ts) = k.decode(), v.decode().split(",")
            age = now - float(ts)
            if age > STALE_S:
                if age > FORGET_S:
                    dead.append(pid)
                continue
            live.add(pid)
            if pid != self.me and at != "-" and age <= self.places_fresh_s():
                places.append((float(at), pid))
        owed = 0
        for k, v in res[-1].items():
            borrower, _, lender = k.decode().partition(">")
            if lender == self.me and borrower in live:
                owed += int(v)
        if dead:  # (processes that stopped long ago: their entries go, so restarts do not pile them up)
            pipe = self.r.pipeline(transaction=False)
            pipe.hdel(places_key, *dead)
            gone_loans = [k for k in res[-1] if k.decode().partition(">")[0] in dead]
            if gone_loans:
                pipe.hdel(loans_key, *gone_loans)
            await pipe.execute()
        return places, owed
