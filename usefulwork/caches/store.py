"""Where cached answers live: one ``Entry`` per answer, filed under its exact key, grouped by partition.

A ``Store`` is the one interface; ``MemoryStore`` (here, the embedded default) and ``RedisStore``
(``usefulwork.caches.redis_store``, shared by gateway replicas) implement it. Every lookup is by
key (a dict or one Redis GET): nothing ever scans keys. Each entry expires ``ttl_s`` after it was
written; a partition keeps at most ``max_entries`` and drops the least recently used first.

The vectors of the semantic cache live in a per-process index (``usefulwork.caches.index``); a
store tells it what to add and forget through ``listener`` (``added(entry)``, ``removed(partition,
key)``, ``purged(partitions)``), for its own writes and (Redis) for the other replicas' writes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson


@dataclass(slots=True)
class Entry:
    key: str  # exact key (``Keys.exact``)
    partition: str
    tenant: str
    model: str
    op: str  # "chat" | "completions"
    text: str  # the conversation as embedded (the guard compares it with a new request's)
    choice: dict[str, Any]  # chat: {"message": {...}, "finish_reason"}; completions: {"text", "finish_reason"}
    usage: dict[str, Any] | None
    vector: np.ndarray | None = None  # float32 unit vector; None when the semantic cache is off
    created: float = field(default_factory=time.time)

    def to_bytes(self) -> bytes:
        return orjson.dumps({"key": self.key, "partition": self.partition, "tenant": self.tenant,
                             "model": self.model, "op": self.op, "text": self.text, "choice": self.choice,
                             "usage": self.usage, "created": self.created})

    @classmethod
    def from_bytes(cls, raw: bytes, vector: np.ndarray | None = None) -> Entry:
        d = orjson.loads(raw)
        return cls(d["key"], d["partition"], d["tenant"], d["model"], d["op"], d["text"], d["choice"],
                   d["usage"], vector, d["created"])


class StoreListener(Protocol):
    def added(self, entry: Entry) -> None: ...

    def removed(self, partition: str, key: str) -> None: ...

    def purged(self, partitions: list[str]) -> None: ...


class StoreError(Exception):
    """The store could not answer (Redis down or slow): the request bypasses the cache."""


class Store(Protocol):
    listener: StoreListener | None

    async def get(self, partition: str, key: str) -> Entry | None:
        """The live entry under ``key`` (marks it recently used), or None."""

    async def put(self, entry: Entry) -> None:
        """File an entry (replacing one with the same key); evicts the partition's LRU beyond the limit."""

    async def forget(self, partition: str, key: str) -> None:
        """Drop one entry (a vector the index still had but whose entry expired)."""

    async def purge(self, tenant: str | None = None, model: str | None = None) -> int:
        """Drop every entry of a tenant and/or model; returns how many partitions went."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class MemoryStore:
    """The in-process store: a dict of entries and one LRU order per partition."""

    def __init__(self, ttl_s: float, max_entries: int, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self.listener: StoreListener | None = None
        self._entries: dict[str, tuple[Entry, float]] = {}  # key -> (entry, expires at)
        self._lru: dict[str, OrderedDict[str, None]] = {}  # partition -> keys, least recently used first
        self._owner: dict[str, tuple[str, str]] = {}  # partition -> (tenant, model)
        self.evicted = 0
        self.expired = 0

    async def get(self, partition: str, key: str) -> Entry | None:
        item = self._entries.get(key)
        if item is None:
            return None
        entry, expires = item
        if expires <= self.clock():
            self.expired += 1
            self._drop(entry.partition, key)
            return None
        self._lru[entry.partition].move_to_end(key)
        return entry

    async def put(self, entry: Entry) -> None:
        order = self._lru.setdefault(entry.partition, OrderedDict())
        self._owner[entry.partition] = (entry.tenant, entry.model)
        self._entries[entry.key] = (entry, self.clock() + self.ttl_s)
        order[entry.key] = None
        order.move_to_end(entry.key)
        if self.listener is not None:
            self.listener.added(entry)
        while len(order) > self.max_entries:
            oldest = next(iter(order))
            self.evicted += 1
            self._drop(entry.partition, oldest)

    async def forget(self, partition: str, key: str) -> None:
        self._drop(partition, key)

    def _drop(self, partition: str, key: str) -> None:
        self._entries.pop(key, None)
        order = self._lru.get(partition)
        if order is not None:
            order.pop(key, None)
            if not order:
                del self._lru[partition]
                self._owner.pop(partition, None)
        if self.listener is not None:
            self.listener.removed(partition, key)

    async def purge(self, tenant: str | None = None, model: str | None = None) -> int:
        gone = [p for p, (t, m) in self._owner.items()
                if (tenant is None or t == tenant) and (model is None or m == model)]
        for p in gone:
            for key in self._lru.pop(p, ()):
                self._entries.pop(key, None)
            del self._owner[p]
        if gone and self.listener is not None:
            self.listener.purged(gone)
        return len(gone)

    def __len__(self) -> int:
        return len(self._entries)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
