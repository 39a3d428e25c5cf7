"""Stored Responses: which replica holds a response the Responses API stored, and whose it is.

vLLM (run with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) keeps a stored response in the memory of the one
server that made it. Behind a gateway with several replicas, ``GET /v1/responses/{id}`` and a request
continuing it (``previous_response_id``) must reach that server, or they get 404 most of the time; and a
response is its tenant's alone. The forwarder notes, for every Responses answer that asked to be stored
(``store`` not false), its id -> ``Owner`` (tenant, pool, replica); a later call naming that id is sent to
that replica only, and another tenant is answered 404 exactly as for an id that does not exist.

``Owners`` has two implementations: ``LocalOwners`` (this process: an LRU of ``max_ids``) and
``RedisOwners`` (``scale_out.redis_url``: every gateway process and replica sees every id, for
``ttl_s``; the local LRU in front, so the process that made a response needs no round trip). The Redis
write is sent in the background; a lookup of an id this process does not know waits for Redis (up to its
timeout) and, if Redis does not answer, is taken as unknown, so the request goes where the picker sends
it (that replica answers 404 when it does not hold the id).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from usefulwork.config import Config

log = logging.getLogger("usefulwork.stored")


@dataclass(frozen=True, slots=True)
class Owner:
    tenant: str
    pool: str
    replica: str  # the base URL of the server that holds the response

    def encode(self) -> bytes:
        return "\t".join((self.tenant, self.pool, self.replica)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Owner | None:
        parts = raw.decode("utf-8", "replace").split("\t")
        return cls(*parts) if len(parts) == 3 else None


class Owners(Protocol):
    def note(self, response_id: str, owner: Owner) -> None: ...

    async def owner(self, response_id: str) -> Owner | None: ...

    async def stop(self) -> None: ...


class LocalOwners:
    """This process's owners, the ``max_ids`` most recently made or used."""

    def __init__(self, max_ids: int):
        self.max_ids = max_ids
        self._ids: OrderedDict[str, Owner] = OrderedDict()

    def note(self, response_id: str, owner: Owner) -> None:
        self._ids[response_id] = owner
        self._ids.move_to_end(response_id)
        if len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def known(self, response_id: str) -> Owner | None:
        owner = self._ids.get(response_id)
        if owner is not None:
            self._ids.move_to_end(response_id)
        return owner

    async def owner(self, response_id: str) -> Owner | None:
        return self.known(response_id)

    async def stop(self) -> None:
        return None


class RedisOwners(LocalOwners):
    """Owners shared through Redis (``{prefix}:resp:{id}``, expiring after ``ttl_s``), this process's LRU in front."""

    def __init__(self, url: str, prefix: str, max_ids: int, ttl_s: float, timeout_s: float = 1.0):
        super().__init__(max_ids)
        import redis.asyncio as aioredis  # noqa: PLC0415 (only when Redis is configured)
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._tasks: set[asyncio.Task] = set()
        self._down_logged = False

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}:resp:{response_id}"

    def note(self, response_id: str, owner: Owner) -> None:
        super().note(response_id, owner)
        task = asyncio.get_running_loop().create_task(self._write(response_id, owner))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, response_id: str, owner: Owner) -> None:
        try:
            await self.redis.set(self._key(response_id), owner.encode(), px=self.ttl_ms)
            self._down_logged = False
        except Exception as exc:  # noqa: BLE001 (fails open: only other processes miss this id)
            self._down(exc)

    async def owner(self, response_id: str) -> Owner | None:
        owner = self.known(response_id)
        if owner is not None:
            return owner
        try:
            raw = await self.redis.get(self._key(response_id))
        except Exception as exc:  # noqa: BLE001
            self._down(exc)
            return None
        owner = Owner.decode(raw) if raw else None
        if owner is not None:
            super().note(response_id, owner)
        return owner

    def _down(self, exc: Exception) -> None:
        if not self._down_logged:
            self._down_logged = True
            log.warning("stored responses: Redis does not answer (%s); ids made by other gateway processes are "
                        "unknown here until it does", exc)

    async def stop(self) -> None:
        if self._tasks:  # the last writes are given their timeout to land
            await asyncio.wait(list(self._tasks))
        await self.redis.aclose()


def build_owners(cfg: Config) -> LocalOwners:
    rc, sc = cfg.responses, cfg.scale_out
    if sc.redis_url:
        return RedisOwners(sc.redis_url, sc.prefix, rc.max_ids, rc.ttl_s)
    return LocalOwners(rc.max_ids)
