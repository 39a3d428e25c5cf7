"""A low-band prompt's prefill in pieces, through the replica's prefix cache (``admission.low_band_prefill_chunk``).

vLLM does not preempt an engine step, and a prompt already being prefilled is a running request whose
next chunk goes before any waiting one, whatever the priorities. So an interactive prompt that reaches a
replica while it prefills a 512-token batch prompt waits for that whole prefill: on a CPU, about as long
as its own first token alone (docs/admission.md, "What no gateway removes"). Sent in pieces, each a
one-token completion of a longer prefix of the same tokens, the batch prompt's prefill becomes a series of
short steps with the interactive prompt free to go between any two; the request itself then finds the
pieces in the prefix cache and prefills only the rest.

While a top-band prompt waits for its first token, the next piece waits too (``PIECE_HOLD``, set by the
admission filter): a piece sent then would share that prompt's step and lengthen it.

The tokens come from the replica itself (vLLM's ``/tokenize``, with the request's messages and chat
settings), so the request's own tokenization finds them. Pieces are whole KV blocks (the replica's
``block_size`` from ``vllm:cache_config_info``): the cache keeps full blocks only. Anything that goes
wrong here (an unknown endpoint, an error, an unexpected answer) ends the pieces and the request goes as
it is: the pieces only move work earlier, they never change the answer.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import orjson

from usefulwork.upstream.http1 import UpstreamError

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Call
    from usefulwork.upstream.fleet import Replica

log = logging.getLogger("usefulwork.pieces")

PREFILL_CHUNK = "prefill_chunk"  # ``Call.memo`` key: tokens per piece, set by the admission filter
PIECES_SENT = "prefill_pieces"  # ``Call.memo`` key: how many pieces the forwarder sent before the request
# ``Call.memo`` key: an async callable the forwarder awaits before each piece (the admission filter's: it returns
# once no top-band prompt is pending in the pool, or after a bounded wait)
PIECE_HOLD = "prefill_piece_hold"
PIECED_OPS = frozenset({"chat", "completions"})  # the operations whose prompt can be tokenized and pieced
# The chat request's fields that shape its tokens (vLLM's /tokenize takes the same)
_CHAT_TOKENIZE_KEYS = ("add_generation_prompt", "continue_final_message", "tools", "chat_template",
                       "chat_template_kwargs", "add_special_tokens", "documents")


def piece_tokens(chunk: int, block_size: float) -> int:
    """Tokens per piece: ``chunk`` rounded up to whole KV blocks (a replica that reports none: ``chunk``)."""
    block = int(block_size)
    return chunk if block <= 0 else max(1, math.ceil(chunk / block)) * block


def tokenize_body(call: Call) -> dict[str, Any] | None:
    """The ``/tokenize`` body that gives the tokens the request itself will be prefilled with (None: none)."""
    body = call.body
    if call.op == "chat" and isinstance(body.get("messages"), list):
        out = {"model": body.get("model"), "messages": body["messages"]}
        out.update({k: body[k] for k in _CHAT_TOKENIZE_KEYS if k in body})
        return out
    if call.op == "completions" and isinstance(body.get("prompt"), str):
        out = {"model": body.get("model"), "prompt": body["prompt"]}
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    return None


def _prompt_ids(call: Call) -> list[int] | None:
    """A completions prompt given as token ids (no tokenization needed)."""
    p = call.body.get("prompt") if call.op == "completions" else None
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return p
    return None


async def _post(replica: Replica, path: bytes, body: dict[str, Any], headers: bytes) -> dict[str, Any] | None:
    """POST ``body`` to the replica; its JSON answer when 200, else None (errors are not raised)."""
    try:
        resp = await replica.http.request(b"POST", path, orjson.dumps(body), headers)  # type: ignore[union-attr]
    except UpstreamError as exc:
        log.debug("prefill pieces: %s on %s: %s", path.decode(), replica.url, type(exc).__name__)
        return None
    try:
        data = await resp.read()
    except UpstreamError:
        return None
    finally:
        resp.close()
    if resp.status != 200:
        log.debug("prefill pieces: %s on %s answered %d", path.decode(), replica.url, resp.status)
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


async def prefill_in_pieces(call: Call, replica: Replica, headers: bytes, chunk: int) -> int:
    """Prefill ``call``'s prompt on ``replica`` in pieces of ``chunk`` tokens (whole blocks), one after another;
    returns how many pieces were sent. A prompt shorter than two pieces is sent as it is (0)."""
    ids = _prompt_ids(call)
    if ids is None:
        tb = tokenize_body(call)
        if tb is None:
            return 0
        answer = await _post(replica, b"/tokenize", tb, headers)
        tokens = answer.get("tokens") if answer is not None else None
        if not isinstance(tokens, list) or not all(isinstance(x, int) for x in tokens):
            return 0
        ids = tokens
    step = piece_tokens(chunk, replica.block_size)
    if len(ids) < 2 * step:
        return 0
    body: dict[str, Any] = {"model": call.body.get("model"), "max_tokens": 1, "stream": False}
    if "priority" in call.body:  # (the admission filter's: the pieces wait in vLLM's queue as the request would)
        body["priority"] = call.body["priority"]
    hold = call.memo.get(PIECE_HOLD)
    sent = 0
    for upto in range(step, len(ids), step):
        if hold is not None:
            await hold()
        if await _post(replica, b"/v1/completions", {**body, "prompt": ids[:upto]}, headers) is None:
            break
        sent += 1
    return sent
