"""Replica choice inside a pool: ``pick(call, replicas) -> replicas, best first``.

The forwarder tries the returned replicas in order (the next one only when the previous failed
before anything reached the client). ``replicas`` are the pool's candidates (healthy ones, or,
when none is known healthy, those whose back-off expired); a picker orders them and may drop some,
never add. Scoring pickers (prefix affinity, load) implement the same one method.

A picker may also have ``feedback(call, replica)``: the forwarder registers it to run when the
reply is closed, when ``call.ctx`` holds the final usage (``cached_tokens`` included), so a prefix
picker can check its prediction against what vLLM reports.

Pickers (``routing.pickers.<pool>.kind``, docs/routing.md):

- ``least-loaded``: fewest outstanding requests first;
- ``round-robin``: each replica in turn;
- ``prefix`` (``PrefixPicker``): approximate, gateway-side prefix-cache affinity. The prompt is cut
  into blocks (tokens of the pool's tokenizer when ``tokenizer`` is set, else ``block_tokens x
  chars_per_token`` characters) and each block gets a hash chained to its parent's, as vLLM's
  prefix cache does, so equal hashes mean equal whole prefixes. A per-replica LRU index remembers
  the blocks each replica was recently sent. Score = ``cache_weight x`` predicted cached share
  ``- load_weight x`` load / (1 + mean load) ``- kv_weight x`` KV usage; best first. Load is this
  gateway's own outstanding requests on the replica (exact and current; the scraped running and
  waiting counts lag by up to a probe interval, and a lagging signal makes every new request
  chase the replica that looked idle); KV usage comes from the scrape.
  Guards: a replica whose load exceeds ``balance_rel x`` the least load ``+ balance_abs`` gets no
  cache bonus (the hot-prefix spiral: one popular prefix must not pile onto one replica; SGLang's
  cache-aware router uses the same kind of balance threshold), and optional session affinity.
  The guard reads two loads: the outstanding requests (a burst, a slow replica) and the requests
  picked over the last ``balance_window_s`` (an exponentially decayed count). At a low rate only a
  few requests are ever outstanding, so the first never crosses ``balance_abs`` and one hot prefix
  could hold three replicas while the fourth served only the cold prefixes; the pick count sees
  that skew within a window.
  Self-check: ``feedback`` compares the predicted cached tokens with vLLM's ``cached_tokens``;
  over-predictions (the replica evicted what the index still lists) shrink that replica's index
  capacity, so stale entries age out faster; accurate ones let it grow back.
- ``precise-prefix`` (``usefulwork/upstream/kv_events.py``): the same scoring, with the index fed
  by each replica's KV-cache events instead of predictions.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from usefulwork.embedding import conversation_text
from usefulwork.gateway.validation import messages_of

if TYPE_CHECKING:
    from usefulwork.config import Config
    from usefulwork.gateway.pipeline import Call
    from usefulwork.routers.config import PickerCfg
    from usefulwork.upstream.fleet import Fleet, Replica

HASHES_MEMO = "prefix_hashes"
PICK_MEMO = "prefix_pick"


class Picker(Protocol):
    def pick(self, call: Call, replicas: list[Replica]) -> list[Replica]: ...


class LeastLoaded:
    """Fewest outstanding requests first (this gateway's in-flight count, or the server's own queue)."""

    name = "least-loaded"

    def pick(self, call: Call, replicas: list[Replica]) -> list[Replica]:
        if len(replicas) < 2:
            return replicas
        return sorted(replicas, key=_load)


def _load(r: Replica) -> float:
    return r.load


class RoundRobin:
    """Each replica in turn (the baseline prefix-aware pickers are measured against)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._n = itertools.count()

    def pick(self, call: Call, replicas: list[Replica]) -> list[Replica]:
        if len(replicas) < 2:
            return replicas
        i = next(self._n) % len(replicas)
        return replicas[i:] + replicas[:i]


# ------------------------------------------------------------------------------------------------
# prefix hashing


class BlockHasher:
    """Chained block hashes of a request's prompt (tokens when a tokenizer is given, else characters)."""

    def __init__(self, block_tokens: int, chars_per_token: float, tokenizer: Any = None):
        self.block_tokens = block_tokens
        self.block_chars = max(1, round(block_tokens * chars_per_token))
        self.tokenizer = tokenizer  # usefulwork.backends.sim.tokens.SimTokenizer (encode, encode_chat)

    def hashes(self, body: dict[str, Any], op: str = "chat") -> list[int]:
        if self.tokenizer is not None:
            return self.token_hashes(self._tokens(body, op))
        text = conversation_text(body)
        bc = self.block_chars
        out: list[int] = []
        parent = 0
        for i in range(0, len(text) - bc + 1, bc):
            parent = hash((parent, text[i:i + bc]))
            out.append(parent)
        return out

    def token_hashes(self, ids: list[int]) -> list[int]:
        bt = self.block_tokens
        out: list[int] = []
        parent = 0
        for i in range(0, len(ids) - bt + 1, bt):
            parent = hash((parent, tuple(ids[i:i + bt])))
            out.append(parent)
        return out

    def _tokens(self, body: dict[str, Any], op: str) -> list[int]:
        """The prompt's token ids as vLLM renders it: a Responses request is a chat of its instructions and
        input items (a string input: the user's message)."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            items = messages_of(body, op)
            messages = None if items is None else [{"role": r, "content": t or ""} for r, t in items]
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        prompt = body.get("prompt", body.get("input", ""))
        if isinstance(prompt, list):
            prompt = "\n".join(map(str, prompt))
        return self.tokenizer.encode(prompt if isinstance(prompt, str) else "")


class BlockIndex:
    """The blocks one replica is believed to hold: an LRU set of block hashes with an adaptive size.

    Blocks of a request are touched deepest first, so an ancestor is never older than its
    descendants: presence is monotone along a chain and the longest cached prefix is found by
    binary search.
    """

    __slots__ = ("blocks", "capacity", "max_capacity")

    def __init__(self, capacity: int):
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = float(capacity)
        self.max_capacity = capacity

    def matched(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` are present."""
        blocks = self.blocks
        if not hashes or hashes[0] not in blocks:
            return 0
        lo, hi = 1, len(hashes)  # hashes[:lo] present; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def touch(self, hashes: list[int]) -> None:
        blocks = self.blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        self._trim()

    def add(self, hashes: list[int]) -> None:
        """Blocks the replica reports it stored (KV events): newest, in the order given."""
        blocks = self.blocks
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        self._trim()

    def remove(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks.pop(h, None)

    def shrink(self, factor: float) -> None:
        self.capacity = max(1.0, min(self.capacity, len(self.blocks)) * factor)
        self._trim()

    def grow(self, factor: float) -> None:
        self.capacity = min(float(self.max_capacity), self.capacity * factor)

    def grow_by(self, blocks: float) -> None:
        self.capacity = min(float(self.max_capacity), self.capacity + blocks)

    def _trim(self) -> None:
        cap = int(self.capacity)
        blocks = self.blocks
        while len(blocks) > cap:
            blocks.popitem(last=False)


# ------------------------------------------------------------------------------------------------
# the approximate prefix picker


class PrefixPicker:
    """Prefix-cache-aware replica choice with a load balance guard and a self-check (module doc)."""

    name = "prefix"
    learns_from_picks = True  # the precise picker learns from KV events instead

    def __init__(self, cfg: PickerCfg, tokenizer: Any = None, meter: Any = None, clock=time.monotonic):
        self.cfg = cfg
        self.clock = clock
        # requests picked per replica, decayed with time constant balance_window_s: url -> (count, at)
        self.recent: dict[str, tuple[float, float]] = {}
        self.hasher = BlockHasher(cfg.block_tokens, cfg.chars_per_token, tokenizer)
        self.index: dict[str, BlockIndex] = {}
        self.sessions: OrderedDict[bytes, str] = OrderedDict()
        self._session_header = cfg.session_header.lower().encode() if cfg.session_header else None
        # self-check figures
        self.checked = 0
        self.accurate = 0
        self.over = 0
        self.under = 0
        self.predicted_tokens = 0
        self.actual_tokens = 0
        # tokens one hashed block stands for: block_tokens with a tokenizer; learned from the
        # server's cached_tokens in characters mode (the chars_per_token ratio is only a start)
        self.tokens_per_block = float(cfg.block_tokens)
        self._otel = _Instruments(meter, self.name) if meter is not None else None

    def _index(self, url: str) -> BlockIndex:
        idx = self.index.get(url)
        if idx is None:
            idx = self.index[url] = BlockIndex(self.cfg.index_blocks)
        return idx

    def replicas_changed(self, added: list[Replica], removed: list[Replica]) -> None:
        """A replica discovery removed takes its index with it (a pod that comes back starts cold)."""
        for r in removed:
            self.index.pop(r.url, None)
            self.recent.pop(r.url, None)

    def _decayed_picks(self, url: str, now: float) -> float:
        count, at = self.recent.get(url, (0.0, now))
        return count * math.exp((at - now) / self.cfg.balance_window_s) if count else 0.0

    def hashes(self, call: Call) -> list[int]:
        h = call.memo.get(HASHES_MEMO)
        if h is None:
            h = call.memo[HASHES_MEMO] = self.hasher.hashes(call.body, call.op)
        return h

    def scores(self, hashes: list[int], replicas: list[Replica]) -> list[tuple[float, int, Replica, float]]:
        """(score, predicted cached blocks, replica, its recent picks) per candidate."""
        cfg = self.cfg
        n = len(hashes)
        loads = [float(r.inflight) for r in replicas]  # this gateway's own count: exact and current
        mean = sum(loads) / len(loads)
        ceiling = cfg.balance_rel * min(loads) + cfg.balance_abs
        if cfg.balance_window_s:
            now = self.clock()
            picks = [self._decayed_picks(r.url, now) for r in replicas]
            pick_ceiling = cfg.balance_rel * min(picks) + cfg.balance_abs
        else:
            picks, pick_ceiling = [0.0] * len(replicas), float("inf")
        out = []
        for r, load, recent in zip(replicas, loads, picks):
            idx = self.index.get(r.url)
            m = idx.matched(hashes) if idx is not None and n else 0
            if m < cfg.min_prefix_blocks:
                m = 0
            bonus = cfg.cache_weight * m / n if m else 0.0
            if bonus and (load > ceiling or recent > pick_ceiling):
                bonus = 0.0  # hot-prefix guard: an overloaded replica gets no affinity
            out.append((bonus - cfg.load_weight * load / (1.0 + mean) - cfg.kv_weight * r.kv_usage, m, r, recent))
        return out

    def pick(self, call: Call, replicas: list[Replica]) -> list[Replica]:
        if not replicas:
            return replicas
        hashes = self.hashes(call)
        scored = self.scores(hashes, replicas)
        scored.sort(key=_score_key, reverse=True)
        ordered = [r for _, _, r, _ in scored]
        if self._session_header is not None:
            ordered = self._affinity(call, ordered)
        first = ordered[0]
        predicted = next(m for _, m, r, _ in scored if r is first)
        call.memo[PICK_MEMO] = (first.url, {r.url: m for _, m, r, _ in scored})
        call.ctx.predicted_cached_tokens = round(predicted * self.tokens_per_block)
        if self.learns_from_picks and hashes:
            self._index(first.url).touch(hashes)
        if self.cfg.balance_window_s:
            now = self.clock()
            self.recent[first.url] = (1.0 + self._decayed_picks(first.url, now), now)
        return ordered

    def _affinity(self, call: Call, ordered: list[Replica]) -> list[Replica]:
        key = call.header(self._session_header)
        if not key:
            return ordered
        url = self.sessions.get(key)
        if url is not None:
            self.sessions.move_to_end(key)
            for i, r in enumerate(ordered):
                if r.url == url:
                    if i:
                        ordered = [r, *ordered[:i], *ordered[i + 1:]]
                    break
        self.sessions[key] = ordered[0].url
        if len(self.sessions) > 100_000:
            self.sessions.popitem(last=False)
        return ordered

    # -- self-check --
    def feedback(self, call: Call, replica: Replica) -> None:
        """Compare the prediction with the cached tokens vLLM reported; adapt the replica's index.

        Accurate: within one block or 25%. A clear miss (under half the predicted tokens were
        cached) means the replica evicted what the index lists: its index shrinks. More cached than
        predicted means the index forgot blocks the replica still holds (it had shrunk too far): it
        grows by the blocks it missed, so a run of misses cannot leave it small for good. In
        characters mode, hits also teach how many tokens a block of characters stands for.
        """
        memo = call.memo.get(PICK_MEMO)
        if memo is None or call.ctx.usage_source != "backend":
            return
        chosen, per_replica = memo
        hashes = call.memo.get(HASHES_MEMO) or []
        blocks = per_replica.get(replica.url, 0)
        if replica.url != chosen and self.learns_from_picks and hashes:  # the forwarder fell back
            self._index(replica.url).touch(hashes)
        actual = call.ctx.cached_tokens
        predicted = round(blocks * self.tokens_per_block)
        if self.hasher.tokenizer is None and blocks and actual:
            self.tokens_per_block += 0.2 * (actual / blocks - self.tokens_per_block)
        tolerance = max(self.cfg.block_tokens, 0.25 * actual)
        self.checked += 1
        self.predicted_tokens += predicted
        self.actual_tokens += actual
        if predicted > actual + tolerance:
            outcome = "over"
            self.over += 1
            idx = self.index.get(replica.url)
            if idx is not None and self.learns_from_picks and actual < 0.5 * predicted:
                idx.shrink(0.9)
        elif actual > predicted + tolerance:
            outcome = "under"
            self.under += 1
            idx = self.index.get(replica.url)
            if idx is not None and self.learns_from_picks:
                idx.grow_by((actual - predicted) / self.tokens_per_block)
        else:
            outcome = "accurate"
            self.accurate += 1
            idx = self.index.get(replica.url)
            if idx is not None:
                idx.grow(1.02)
        if self._otel:
            self._otel.checks.add(1, {"outcome": outcome})
            self._otel.predicted.add(predicted)
            self._otel.actual.add(actual)

    @property
    def accuracy(self) -> float | None:
        return self.accurate / self.checked if self.checked else None

    def stats(self) -> dict[str, Any]:
        return {"kind": self.name, "checked": self.checked, "accuracy": self.accuracy, "over": self.over,
                "tokens_per_block": round(self.tokens_per_block, 2),
                "under": self.under, "predicted_tokens": self.predicted_tokens, "cached_tokens": self.actual_tokens,
                "index_blocks": {u: len(i.blocks) for u, i in self.index.items()},
                "index_capacity": {u: int(i.capacity) for u, i in self.index.items()}}


def _score_key(t: tuple[float, int, Replica, float]) -> tuple[float, float, float]:
    # ties go to the least loaded, then to the replica picked least lately (not to the first listed:
    # at a low rate idle replicas tie all the time, and list order piled requests onto one)
    return (t[0], -t[2].inflight, -t[3])


class _Instruments:
    def __init__(self, meter: Any, kind: str):
        self.checks = meter.create_counter(
            "usefulwork.picker.prefix_checks", unit="{request}",
            description=f"{kind} picker: predicted cached prefix vs vLLM's cached_tokens (outcome: accurate|over|under)")
        self.predicted = meter.create_counter("usefulwork.picker.predicted_cached_tokens", unit="{token}",
                                              description="Cached prompt tokens the prefix picker predicted")
        self.actual = meter.create_counter("usefulwork.picker.reported_cached_tokens", unit="{token}",
                                           description="Cached prompt tokens vLLM reported for those requests")


# ------------------------------------------------------------------------------------------------


def tokenizer_problem(path: str | None) -> str | None:
    """Why ``path`` is not a tokenizer a prefix picker can load (None: it is, or none is asked for). A folder
    without tokenizer.json would leave the simulator's tokenizer hashing characters, silently."""
    if not path or path in ("sim", "approx") or (Path(path) / "tokenizer.json").is_file():
        return None
    return f"{path} has no tokenizer.json (a model folder, or \"sim\")"


def load_tokenizer(path: str | None) -> Any:
    """The pool's tokenizer: a model folder, "sim" (the simulator's own), or None (characters)."""
    if not path:
        return None
    if (why := tokenizer_problem(path)) is not None:
        raise ValueError(why)
    from usefulwork.backends.sim.tokens import load_tokenizer as load  # noqa: PLC0415 (tokenizers + template)
    return load(None if path == "sim" else path)


def build_picker(cfg: PickerCfg, meter: Any = None) -> Picker:
    if cfg.kind == "least-loaded":
        return LeastLoaded()
    if cfg.kind == "round-robin":
        return RoundRobin()
    if cfg.kind == "prefix":
        return PrefixPicker(cfg, load_tokenizer(cfg.tokenizer), meter)
    if cfg.kind == "precise-prefix":
        from usefulwork.upstream.kv_events import PrecisePrefixPicker  # noqa: PLC0415
        return PrecisePrefixPicker(cfg, load_tokenizer(cfg.tokenizer), meter)
    raise ValueError(f"kind: unknown picker {cfg.kind!r}")


def build_pickers(cfg: Config, fleet: Fleet, meter: Any = None) -> dict[str, Picker]:
    """One picker per pool (the forwarder asks ``pickers[pool.name]``), as ``routing.pickers`` says.

    A picker with per-replica state (``replicas_changed``) hears of every replica discovery adds or removes.
    """
    pickers = {name: build_picker(cfg.routing.picker_for(name), meter) for name in fleet.pools}

    def changed(pool: Any, added: list[Replica], removed: list[Replica]) -> None:
        hook = getattr(pickers.get(pool.name), "replicas_changed", None)
        if hook is not None:
            hook(added, removed)

    fleet.on_change(changed)
    return pickers
