"""Paged KV cache with automatic prefix caching, shaped like vLLM V1's KVCacheManager/BlockPool.

- Fixed-size blocks (``block_size`` tokens). A request holds a list of block ids.
- A full block is identified by a hash chain: hash(parent block hash, the block's token ids), so
  two requests share a block only if their whole prefix up to it is identical.
- Freed blocks keep their hash and go to the tail of an LRU free queue: they can still be hit by a
  later request until they are evicted (taken from the head of the queue for a new allocation).
  A request's blocks are freed in reverse so that its tail blocks are evicted first (as vLLM does).
- Prefix lookups never return the block holding the prompt's last token: vLLM must recompute the
  last prompt token to get logits, so at most ``(len - 1) // block_size`` blocks hit.
- With ``events`` on, it records vLLM's KV-cache events (``BlockStored`` when blocks become
  cacheable, ``BlockRemoved`` on eviction, ``AllBlocksCleared`` on reset) as plain dicts shaped like
  vLLM's msgspec structs; ``take_events`` drains them (the server publishes them, ``sim/kv_events.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence


class CacheUser(Protocol):
    """What the cache needs from a request (SimRequest provides it)."""

    token_ids: list[int]
    blocks: list[int]
    block_hashes: list[int]
    num_cached_blocks: int


def extend_block_hashes(req: CacheUser, block_size: int) -> None:
    """Hash every full block of req.token_ids that has no hash yet (parent-chained)."""
    hashes = req.block_hashes
    full = len(req.token_ids) // block_size
    parent = hashes[-1] if hashes else 0
    for i in range(len(hashes), full):
        parent = hash((parent, tuple(req.token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, events: bool = False):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # head = LRU
        self.events: list[dict] | None = [] if events else None

    def take_events(self) -> list[dict]:
        out, self.events = self.events or [], ([] if self.events is not None else None)
        return out

    # -- reads --
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """vllm:kv_cache_usage_perc: share of blocks not free (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, req: CacheUser, total_tokens: int) -> int:
        return max(0, -(-total_tokens // self.block_size) - len(req.blocks))

    def find_prefix(self, req: CacheUser) -> list[int]:
        """Cached blocks matching req's leading full blocks (never the one with the last token)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        hits: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    # -- writes --
    def allocate(self, req: CacheUser, total_tokens: int, hit_blocks: Sequence[int] = ()) -> bool:
        """Give req blocks for `total_tokens` tokens (after adopting hit_blocks); False if they do not fit."""
        need = max(0, -(-total_tokens // self.block_size) - len(req.blocks) - len(hit_blocks))
        reusable = sum(1 for b in hit_blocks if self.ref[b] == 0)  # hits that now sit in the free queue
        if need > len(self.free) - reusable:
            return False
        for b in hit_blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            req.blocks.append(b)
        if hit_blocks:
            req.num_cached_blocks = len(req.blocks)
        for _ in range(need):
            b, _unused = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: its content is overwritten now
                if self.cached.get(h) == b:
                    del self.cached[h]
                    if self.events is not None:
                        self.events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"})
                self.block_hash[b] = None
            self.ref[b] = 1
            req.blocks.append(b)
        return True

    def cache_full_blocks(self, req: CacheUser, num_computed_tokens: int) -> None:
        """Register req's blocks that are now full and computed, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        full = min(num_computed_tokens // self.block_size, len(req.block_hashes), len(req.blocks))
        stored: list[int] = []
        for i in range(req.num_cached_blocks, full):
            h = req.block_hashes[i]
            b = req.blocks[i]
            if h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
            stored.append(h)
        if stored and self.events is not None:  # as vLLM: every newly full block of the request
            first = req.num_cached_blocks
            bs = self.block_size
            self.events.append({"type": "BlockStored", "block_hashes": stored,
                                "parent_block_hash": req.block_hashes[first - 1] if first else None,
                                "token_ids": list(req.token_ids[first * bs:full * bs]), "block_size": bs,
                                "lora_id": None, "medium": "GPU", "lora_name": None})
        if full > req.num_cached_blocks:
            req.num_cached_blocks = full

    def free_request(self, req: CacheUser) -> None:
        for b in reversed(req.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        req.blocks.clear()
        req.num_cached_blocks = 0

    def reset_prefix_cache(self) -> None:
        if self.events is not None:
            self.events.append({"type": "AllBlocksCleared"})
        for b in list(self.free):
            h = self.block_hash[b]
            if h is not None:
                self.cached.pop(h, None)
                self.block_hash[b] = None
