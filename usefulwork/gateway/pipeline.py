"""The request path's types: a ``Call`` goes down an ordered chain of filters and a ``Reply`` comes back.

::

    endpoint (raw ASGI): read + validate, identify the tenant, build the Call
       chain: [filter] -> [filter] -> ... -> Forwarder (picker: ordered replicas, lease, retry)
    endpoint <- Reply (status, headers, body or SSE chunks): the only code that sends to the client
    outcome classified once (``classify``) -> ledger

A filter is ``async (call, next) -> Reply``. It may answer early (return its own Reply: a cache hit,
a shed), change the call (a router sets ``call.pool``), wrap the reply's chunks (replace
``reply.chunks`` with an iterator over the old one), or call ``next`` more than once (escalate to
another pool). Filters write what they decided into ``call.ctx`` (the ledger record). Which filters
run and in which order is ``Config.filters`` (names from ``usefulwork.gateway.filters.FILTERS``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Protocol

from usefulwork.gateway.context import Outcome, RequestContext
from usefulwork.gateway.tenants import Tenants

if TYPE_CHECKING:
    from usefulwork.config import Config
    from usefulwork.gateway.context import Accountant
    from usefulwork.upstream.fleet import Fleet, PoolState

Headers = list[tuple[bytes, bytes]]


class ClientGone(Exception):
    """The client disconnected; the request is abandoned (upstream work is cancelled)."""


DISCONNECT = "usefulwork.disconnect"  # ASGI scope extension offered by the gateway's own HTTP protocol


class DisconnectWatch:
    """``scope["extensions"][DISCONNECT]``: how the gateway's HTTP protocol (gateway/client_protocol.py)
    tells the request that its client went away, without a task waiting on ``receive()``.

    The protocol calls ``fire()`` when the connection is lost before the request's response completed;
    ``gone`` stays set, and ``callback`` (set by the endpoint while it serves) runs once. Under another
    ASGI server the extension is absent and the endpoint watches ``receive()`` instead. ``task`` is the
    task the protocol started to run the request's ASGI app (the one a disconnect cancels), when it
    knows it: the endpoint then needs no ``asyncio.current_task()`` lookup.
    """

    __slots__ = ("callback", "gone", "task")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.gone = False
        self.task: asyncio.Task | None = None

    def fire(self) -> None:
        if self.gone:
            return
        self.gone = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


@dataclass(slots=True, eq=False)
class Call:
    """One client request on its way through the chain; built once at intake."""

    ctx: RequestContext  # the record that ends in the ledger; filters note their decisions here
    op: str  # "chat" | "completions" | "responses" | "embeddings"
    path: bytes  # upstream path, e.g. b"/v1/chat/completions"
    body: dict[str, Any]  # parsed and validated JSON body
    raw: bytes | None  # the client's bytes, forwarded untouched; None once a filter changed ``body``
    pool: PoolState | None  # the model's pool (None for a virtual model until a router sets it)
    headers: Headers  # the client's request headers (ASGI form: lower-case names)
    memo: dict[str, Any] = field(default_factory=dict)  # values filters share (e.g. "embedding")

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def set_body(self, body: dict[str, Any]) -> None:
        """Replace the body; the forwarder re-encodes it."""
        self.body = body
        self.raw = None


class Reply:
    """A response produced by a handler, not yet sent: a whole body, or an iterator of SSE bytes.

    ``chunks`` yields complete SSE events (one or more per item); iterating it may raise an
    ``UpstreamError`` when the upstream fails after streaming began: the endpoint then ends the
    stream with an SSE error event. ``usage`` is the OpenAI usage object once known (for streams,
    after the last chunk). ``aclose`` releases whatever the reply holds (the replica lease, the
    upstream connection); the endpoint always calls it, also when the client goes away.
    """

    __slots__ = ("status", "headers", "body", "chunks", "usage", "_closers")

    def __init__(self, status: int, headers: Headers | None = None, body: bytes | None = None,
                 chunks: AsyncIterator[bytes] | None = None, usage: dict[str, Any] | None = None):
        self.status = status
        self.headers = headers if headers is not None else []
        self.body = body
        self.chunks = chunks
        self.usage = usage
        self._closers: list[Callable[[], Any]] = []

    @property
    def streaming(self) -> bool:
        return self.chunks is not None

    def on_close(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` (sync, or returning an awaitable) when the reply is closed; last added runs first."""
        self._closers.append(fn)

    async def aclose(self) -> None:
        closers, self._closers = self._closers, []
        for fn in reversed(closers):
            r = fn()
            if r is not None and asyncio.iscoroutine(r):  # (None, most closers' result, is an ABC check each)
                await r

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


Handler = Callable[[Call], Awaitable[Reply]]


class Filter(Protocol):
    """One step of the request path. ``name`` is the name used in ``Config.filters``.

    Optional members the gateway uses when a filter has them:
    - ``routes``: a list of Starlette routes to mount (admin endpoints, feedback endpoints);
    - ``stats() -> dict``: live figures, shown under ``filters.<name>`` in ``/usefulwork/stats``
      and on the dashboard (tenant-scoped figures only in the fleet view);
    - ``async start()`` / ``async stop()``: run with the app's lifespan (background tasks, stores).
    """

    name: str

    async def __call__(self, call: Call, next: Handler) -> Reply: ...


@dataclass(slots=True)
class Services:
    """What a filter factory may use to build its filter (one per gateway process)."""

    cfg: Config
    fleet: Fleet
    accountant: Accountant
    meter: Any = None  # the gateway's OpenTelemetry Meter: instruments made here reach /metrics and OTLP
    # Model names a filter resolves itself (virtual models such as "auto"): intake accepts them
    # even though no pool serves them; the filter must set ``call.pool`` before the forwarder.
    virtual_models: set[str] = field(default_factory=set)
    # Who is calling: the gateway's one key -> tenant table (None: built from cfg), which a reload (SIGHUP)
    # replaces in place, so a filter reads each tenant's settings from it per request, never from cfg.
    tenants: Tenants | None = None

    def __post_init__(self) -> None:
        if self.tenants is None:
            self.tenants = Tenants(self.cfg)


def chain(filters: list[Filter], last: Handler) -> Handler:
    """Compose filters into one handler: ``filters[0]`` sees the call first and the reply last."""
    handler = last
    for f in reversed(filters):
        handler = _bind(f, handler)
    return handler


def _bind(f: Filter, next_: Handler) -> Handler:
    async def step(call: Call) -> Reply:
        return await f(call, next_)
    return step


def classify(status: int, exc: BaseException | None = None) -> Outcome:
    """The one place a request's end becomes an outcome (ledger, metrics, SLO).

    ``exc`` is what ended the request abnormally (None when a response was fully sent). A 429 is
    ``shed`` (capacity said no: the gateway's admission, or an upstream's own limit); other 4xx are
    ``rejected`` (the client's input); 504 and timeouts are ``timeout``; other 5xx and failures
    are ``error``.
    """
    if exc is not None:
        if isinstance(exc, ClientGone):
            return "client_cancelled"
        from usefulwork.upstream.http1 import UpstreamTimeout  # noqa: PLC0415 (keeps this module light)
        if isinstance(exc, (UpstreamTimeout, asyncio.TimeoutError)):
            return "timeout"
        return "error"
    if status < 400:
        return "ok"
    if status == 429:
        return "shed"
    if status == 504:
        return "timeout"
    return "rejected" if status < 500 else "error"
