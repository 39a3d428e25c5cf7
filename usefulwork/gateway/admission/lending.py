"""Places lent between gateway processes through Redis (``PoolQueue._borrow``).

Behind a load balancer that sends each attempt to the next gateway process, a client's retry reaches another
process than the one whose slots priced its Retry-After, and the processes' slots free at different times.
Each process publishes, every ``interval_s``, when its next slot frees with nobody of its own to take it
(``PoolQueue.next_place``) and how many slots it runs on loan from each other process. A retry with no slot
near takes a place another process published within its budget; the lender reads how many of its slots
others hold on loan and leaves as many idle, until the borrower's next request ends and it gives one back.

Each process also publishes the places it holds for the retries of the requests it shed, due soon (key, time,
when promised, shed count), and the keys of other processes' places it took: a retry that reaches another
process than the one that holds its place claims it there (``PoolQueue._take_fleet_place``), and the holder
lets it go at the next exchange, or lends it when the process the retry reached has no slot in time.

What is published is absolute (a place, a count of loans, the places held, the places taken lately), so a
lost or repeated exchange settles at the next one. A process whose entry is older than ``STALE_S`` is gone: its places are not offered and the loans
it held are void (a borrower that died frees its lenders' slots). Redis down: each process on its own slots.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, NamedTuple

STALE_S = 3.0  # a process that has not published for this long is gone (its loans void)
FORGET_S = 60.0  # and after this long its entries are deleted

Held = tuple[int, float, float, int]  # a place held for a retry: (its request's key, its time, promised at, shed count)


class Exchange(NamedTuple):
    places: list[tuple[float, str]]  # the other live processes' next places (wall seconds, process), as published
    owed: int  # how many of this process's slots other live processes hold on loan
    held: dict[int, tuple[float, float, int, str]]  # key -> (time, promised at, shed count, process) of others' held places
    taken: list[tuple[int, float]]  # (key, time) of this process's held places other processes took lately


def _pack_held(held: list[Held]) -> str:
    return ";".join(f"{k},{at!r},{since!r},{sheds}" for k, at, since, sheds in held)


def _pack_took(took: list[tuple[int, float, str]]) -> str:
    return ";".join(f"{k},{at!r},{lender}" for k, at, lender in took)


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

    async def exchange(self, pool: str, next_at: float | None, loans: Counter[str], now: float,
                       held: list[Held] = (), took: list[tuple[int, float, str]] = ()) -> Exchange:  # type: ignore[assignment]
        """Publish this process's next place (``next_at``, wall seconds; None: none in sight), its loans per
        lender, the places it holds for retries due soon (``held``) and the places of other processes it took
        lately (``took``: key, time, holder); return what the other live processes published (``Exchange``).
        One pipeline."""
        keys = [f"{self.prefix}:{x}:{pool}" for x in ("places", "loans", "held", "took")]
        places_key, loans_key, held_key, took_key = keys
        fields = {f"{self.me}>{lender}": n for lender, n in loans.items() if n > 0}
        gone = self._fields.get(pool, set()) - set(fields)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(places_key, self.me, f"{'-' if next_at is None else repr(next_at)},{now!r}")
        pipe.hset(held_key, self.me, f"{now!r}|{_pack_held(held)}")
        pipe.hset(took_key, self.me, f"{now!r}|{_pack_took(took)}")
        if fields:
            pipe.hset(loans_key, mapping=fields)
        if gone:
            pipe.hdel(loans_key, *gone)
        for k in keys:
            pipe.expire(k, 3600)
        for k in keys:
            pipe.hgetall(k)
        res = await pipe.execute()
        self._fields[pool] = set(fields)
        live, places, dead = set(), [], []
        for k, v in res[-4].items():
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
        for k, v in res[-3].items():
            borrower, _, lender = k.decode().partition(">")
            if lender == self.me and borrower in live:
                owed += int(v)
        others_held: dict[int, tuple[float, float, int, str]] = {}
        for pid, body in self._fresh(res[-2], now):
            for item in body.split(";"):
                k, at, since, sheds = item.split(",")
                others_held[int(k)] = (float(at), float(since), int(sheds), pid)
        taken = []
        for _, body in self._fresh(res[-1], now):
            for item in body.split(";"):
                k, at, lender = item.split(",")
                if lender == self.me:
                    taken.append((int(k), float(at)))
        if dead:  # (processes that stopped long ago: their entries go, so restarts do not pile them up)
            pipe = self.r.pipeline(transaction=False)
            for k in (places_key, held_key, took_key):
                pipe.hdel(k, *dead)
            gone_loans = [k for k in res[-3] if k.decode().partition(">")[0] in dead]
            if gone_loans:
                pipe.hdel(loans_key, *gone_loans)
            await pipe.execute()
        return Exchange(places, owed, others_held, taken)

    def _fresh(self, entries: dict[bytes, bytes], now: float) -> list[tuple[str, str]]:
        """Other processes' non-empty ``ts|body`` entries published within ``places_fresh_s``: (process, body)."""
        out = []
        for k, v in entries.items():
            pid = k.decode()
            ts, _, body = v.decode().partition("|")
            if pid != self.me and body and now - float(ts) <= self.places_fresh_s():
                out.append((pid, body))
        return out
