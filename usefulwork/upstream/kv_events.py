"""The precise prefix picker: an index of the blocks each replica really holds, from its KV-cache events.

Each replica named in ``kv_events_endpoints`` is subscribed to (ZMQ SUB; the wire format is vLLM's,
see ``usefulwork/backends/sim/kv_events.py``). ``BlockStored`` events carry the stored blocks' token
ids and their parent's hash, so the gateway re-derives its own chained hash for each block, the one
``BlockHasher.token_hashes`` computes for a request's prompt tokens (the server's hash values stay
opaque: they may be seeded sha256 digests); ``BlockRemoved`` and ``AllBlocksCleared`` drop entries.
Scoring, guards and the self-check are the approximate picker's (``pickers.PrefixPicker``); only the
index's source differs, which is why it needs the pool's tokenizer (``tokenizer``) and the server's
block size (``block_tokens``), as llm-d's precise prefix-cache scorer does.

Subscribers start on the first ``pick`` (they need the gateway's event loop) and stop with ``stop``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from usefulwork.upstream.pickers import BlockIndex, PrefixPicker

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Call
    from usefulwork.routers.config import PickerCfg
    from usefulwork.upstream.fleet import Replica

log = logging.getLogger("usefulwork.kv_events")
UNBOUNDED = 1 << 40  # the events say what leaves; the index itself never trims


class PrecisePrefixPicker(PrefixPicker):
    name = "precise-prefix"
    learns_from_picks = False

    def __init__(self, cfg: PickerCfg, tokenizer: Any = None, meter: Any = None):
        if tokenizer is None:
            raise ValueError("tokenizer: the precise-prefix picker needs the pool's tokenizer (model folder)")
        if not cfg.kv_events_endpoints and cfg.kv_events_port is None:
            raise ValueError("kv_events_endpoints: the precise-prefix picker needs one endpoint per replica "
                             "(or kv_events_port, for replicas found by discovery)")
        super().__init__(cfg, tokenizer, meter)
        self.endpoints = dict(cfg.kv_events_endpoints)
        self.ours: dict[str, dict[Any, int]] = {url: {} for url in self.endpoints}  # server hash -> our hash
        self.events = 0
        self.unchained = 0  # stored blocks whose parent was never seen (events missed): not indexed
        self._tasks: dict[str, asyncio.Task] | None = None  # replica URL -> its subscriber (once started)

    def _index(self, url: str) -> BlockIndex:
        idx = self.index.get(url)
        if idx is None:
            idx = self.index[url] = BlockIndex(UNBOUNDED)
        return idx

    # -- events --
    def apply(self, url: str, events: list[Any]) -> None:
        """Apply one batch of decoded events (maps tagged by ``type``) for replica ``url``."""
        idx = self._index(url)
        ours = self.ours.setdefault(url, {})
        for ev in events:
            self.events += 1
            kind = ev.get("type") if isinstance(ev, dict) else None
            if kind == "BlockStored":
                if ev.get("medium") not in (None, "GPU"):
                    continue  # offloaded tiers are not the prefix cache a request hits first
                bs = int(ev["block_size"])
                if bs != self.hasher.block_tokens:
                    self._adopt_block_size(url, bs)
                parent_ext = ev.get("parent_block_hash")
                parent = 0 if parent_ext is None else ours.get(parent_ext)
                if parent is None:
                    self.unchained += len(ev["block_hashes"])
                    continue
                tokens = ev["token_ids"]
                new = []
                for i, ext in enumerate(ev["block_hashes"]):
                    parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
                    ours[ext] = parent
                    new.append(parent)
                idx.add(new)
            elif kind == "BlockRemoved":
                if ev.get("medium") not in (None, "GPU"):
                    continue
                idx.remove([h for h in (ours.pop(ext, None) for ext in ev["block_hashes"]) if h is not None])
            elif kind == "AllBlocksCleared":
                idx.blocks.clear()
                ours.clear()

    def _adopt_block_size(self, url: str, bs: int) -> None:
        """The server's block size wins over ``block_tokens``: a request's hashes must cut its prompt where
        the server cuts its blocks, or nothing would ever match (vLLM's CPU build uses 128, GPUs 16)."""
        log.warning("precise-prefix: %s stores blocks of %d tokens, not block_tokens=%d; using %d",
                    url, bs, self.hasher.block_tokens, bs)
        self.hasher.block_tokens = bs
        self.tokens_per_block = float(bs)

    async def _subscribe(self, url: str, endpoint: str) -> None:
        import msgspec  # noqa: PLC0415 (the kv-events extra)
        import zmq  # noqa: PLC0415
        import zmq.asyncio  # noqa: PLC0415

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        decode = msgspec.msgpack.Decoder().decode
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    batch = decode(frames[-1])
                    self.apply(url, batch[1])
                except Exception:  # a malformed batch must not stop the subscriber
                    log.exception("bad KV event batch from %s", endpoint)
        finally:
            sock.close(linger=0)

    def start(self) -> None:
        if self._tasks is None:
            self._tasks = {}
            for u, e in self.endpoints.items():
                self._start_one(u, e)

    def _start_one(self, url: str, endpoint: str) -> None:
        self._tasks[url] = asyncio.get_running_loop().create_task(self._subscribe(url, endpoint), name=f"kv-events {url}")

    def replicas_changed(self, added: list[Replica], removed: list[Replica]) -> None:
        """Discovery: subscribe to a new replica's publisher (kv_events_port), drop a removed one's."""
        for r in removed:
            self.index.pop(r.url, None)
            self.ours.pop(r.url, None)
            task = (self._tasks or {}).pop(r.url, None)
            if task is not None:
                task.cancel()
            if self.cfg.kv_events_port is not None:
                self.endpoints.pop(r.url, None)
        if self.cfg.kv_events_port is None:
            return
        for r in added:
            if r.url in self.endpoints:
                continue
            host = urlsplit(r.url).hostname or ""
            endpoint = self.endpoints[r.url] = f"tcp://{f'[{host}]' if ':' in host else host}:{self.cfg.kv_events_port}"
            self.ours[r.url] = {}
            if self._tasks is not None:
                self._start_one(r.url, endpoint)

    async def stop(self) -> None:
        tasks = list((self._tasks or {}).values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = None

    def pick(self, call: Call, replicas: list[Replica]) -> list[Replica]:
        if self._tasks is None:
            self.start()
        return super().pick(call, replicas)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "events": self.events, "unchained_blocks": self.unchained}
