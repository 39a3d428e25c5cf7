"""Pass upstream SSE bytes through with as little work as possible.

Upstream chunks are re-framed on the blank line that ends an SSE event (a network read can hold
part of an event or several), and forwarded as they complete. No chunk is JSON-decoded, except
the one carrying a non-null ``usage`` object: it is read for accounting and, when the client did
not ask for usage (we always ask upstream), removed. Cost per chunk: one ``find`` for the event
boundary and one for ``"usage":{``, both in C.
"""

from __future__ import annotations

import orjson

from usefulwork.upstream.http1 import UpstreamTooLarge

MAX_EVENT_BYTES = 1 << 20  # default bound on one event (config: limits.max_sse_event_bytes)
_SEP = b"\n\n"
_USAGE = b'"usage":{'
_USAGE_SPACED = b'"usage": {'
DONE_EVENT = b"data: [DONE]\n\n"


class SSEFilter:
    """Re-frames one upstream stream. An unfinished event is kept as a list of reads, joined once
    when its end arrives (linear cost however it is split), and may not exceed ``max_event_bytes``
    (``UpstreamTooLarge``: the caller ends the stream with an error event)."""

    __slots__ = ("_parts", "_size", "keep_usage", "usage", "events", "done", "max_event_bytes")

    def __init__(self, keep_usage: bool, max_event_bytes: int = MAX_EVENT_BYTES):
        self._parts: list[bytes] = []  # an unfinished event's reads; none holds a whole separator
        self._size = 0
        self.keep_usage = keep_usage
        self.usage: dict | None = None
        self.events = 0  # complete events forwarded (excluding [DONE])
        self.done = False
        self.max_event_bytes = max_event_bytes

    def _keep(self, part: bytes) -> None:
        self._parts.append(part)
        self._size += len(part)
        if self._size > self.max_event_bytes:
            raise UpstreamTooLarge(f"an upstream SSE event exceeds the limit of {self.max_event_bytes} bytes")

    def feed(self, chunk: bytes) -> bytes:
        """Take raw upstream bytes; return the complete events to forward (possibly b"")."""
        end = chunk.rfind(_SEP)
        if self._parts:
            if end < 0 and not (chunk[:1] == b"\n" and self._parts[-1][-1:] == b"\n"):
                self._keep(chunk)  # the event goes on: only the new bytes were scanned
                return b""
            head = self._size
            chunk = b"".join(self._parts) + chunk
            self._parts = []
            self._size = 0
            end = chunk.rfind(_SEP, max(head - 1, 0)) if end < 0 else end + head
        if end < 0:
            self._keep(chunk)
            return b""
        end += 2
        if end < len(chunk):
            self._keep(chunk[end:])
        out = chunk[:end]
        if _USAGE in out or _USAGE_SPACED in out:
            out = self._take_usage(out)
        self.events += out.count(b"data: ")
        if out.endswith(DONE_EVENT):
            self.done = True
            self.events -= 1
        return out

    def flush(self) -> bytes:
        """Whatever is left when upstream closes (an unterminated last event)."""
        rest = b"".join(self._parts)
        self._parts = []
        self._size = 0
        return rest

    @staticmethod
    def error_event(message: str, code: int = 502, type_: str = "upstream_error") -> bytes:
        """How this kind of stream says it failed after it began (then it ends)."""
        return error_event(message, code, type_)

    def _take_usage(self, out: bytes) -> bytes:
        kept = []
        for event in out.split(_SEP):
            if not event:
                continue
            if (_USAGE in event or _USAGE_SPACED in event) and event.startswith(b"data: {"):
                try:
                    obj = orjson.loads(event[6:])
                except orjson.JSONDecodeError:
                    kept.append(event)
                    continue
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    self.usage = usage
                    # The usage-only chunk has no choices: drop it unless the client asked for it.
                    if not self.keep_usage and not obj.get("choices"):
                        continue
            kept.append(event)
        return b"".join(e + _SEP for e in kept)


def error_event(message: str, code: int = 502, type_: str = "upstream_error") -> bytes:
    """An SSE error event followed by [DONE], for failures after streaming began."""
    body = orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
    return b"data: " + body + _SEP + DONE_EVENT


_PREAMBLE = (b"event: response.created\n", b"event: response.in_progress\n")


def first_token_in(op: str, chunk: bytes) -> bool:
    """Whether a stream's chunk, sent before any other did, carries its first token. A chat or completions
    stream's first chunk does (vLLM sends its role chunk with the first output); a Responses stream's
    first chunk to hold more than the two events vLLM sends before the prefill (``response.created``,
    ``response.in_progress``) does."""
    if op != "responses":
        return True
    for event in chunk.split(_SEP):
        if event and not event.startswith(_PREAMBLE):
            return True
    return False


class ResponsesSSE(SSEFilter):
    """The Responses API's stream (``POST /v1/responses``): typed events and no ``[DONE]``.

    Usage arrives inside the terminal ``response.completed`` (or ``response.incomplete``) event's
    ``response`` object; that event ends the stream. Nothing is stripped: the client always gets it.
    """

    __slots__ = ("response_id",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.response_id: str | None = None  # the terminal event's response id (a stored response's)

    def _take_usage(self, out: bytes) -> bytes:
        for event in out.split(_SEP):
            start = event.find(b"data: {")
            if start < 0 or not (_USAGE in event or _USAGE_SPACED in event):
                continue
            try:
                obj = orjson.loads(event[start + 6:])
            except orjson.JSONDecodeError:
                continue
            resp = obj.get("response") if isinstance(obj, dict) else None
            usage = resp.get("usage") if isinstance(resp, dict) else None
            if isinstance(usage, dict):
                self.usage = usage
            if obj.get("type") in RESPONSES_TERMINAL:
                self.done = True
                if isinstance(resp, dict) and isinstance(resp.get("id"), str):
                    self.response_id = resp["id"]
        return out

    @staticmethod
    def error_event(message: str, code: int = 502, type_: str = "upstream_error") -> bytes:
        body = orjson.dumps({"type": "error", "code": str(code), "message": message, "param": None,
                             "error_type": type_})
        return b"event: error\ndata: " + body + _SEP


RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
