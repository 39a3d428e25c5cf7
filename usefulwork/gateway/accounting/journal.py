"""A write-ahead journal of finished requests, so a gateway that dies (SIGKILL, the OOM killer) loses
no ledger record of a request it answered.

The ledger holds a finished request's record in memory until its GPU-time share settles (up to
``ledger.max_hold_s`` + an interval + a flush: 6.5 s by default) and until the sinks confirm it. A
SIGKILL lost those records: ~290 of the 1,000 a killed gateway had answered at 100 req/s
(docs/benchmarks.md section 12). With a sink configured, each request is also appended to this
journal just before its response's last bytes are written (``Ledger.answered``), and again when it
finishes only if its record changed in between: a copy into a shared memory map of the journal file
(no system call: the pages are the kernel's page cache, so the row survives the process, though not
the machine), no fsync on the request path. When every
sink has confirmed a batch of records, the journal notes their ids (an ``ack`` line). What survives
a kill is therefore the journal's unacknowledged requests.

Files, in ``ledger.journal_dir`` (default: one directory per set of sinks,
``.usefulwork-journal/<digest>`` beside the JSONL ledger, or under the cache dir for a Redis stream
alone): ``<tag>.lock``, held with ``flock`` for the process's life, and segments ``<tag>.<n>.jsonl``
(rows, then zeros to the mapped size), a new one every ``ROTATE_S`` or when full; a segment is
deleted once its requests and every older segment's are acknowledged. A clean stop acknowledges
everything and leaves nothing.

Recovery (``adopt_orphans``): a lock file whose ``flock`` can be taken belongs to a dead process. The
ledger of any gateway sharing the directory takes it (at start, then every ``ADOPT_EVERY_S``),
journals the dead process's unacknowledged requests as its own, deletes the dead process's files,
and writes their records to its own sinks, marked ``recovered`` with ``gpu_cost_usd`` null (the dead
process's GPU-time books died with it). So a restarted gateway recovers its own records at start, and
on one host (``serve --workers``, several gateways) a sibling recovers them within seconds. Delivery is
at least once: a kill between a sink's write and the ``ack`` line that follows it writes those
records again (consumers dedupe on ``id``).

The row goes before the last write, not after: a client woken by its answer may run first on the
CPU and kill the gateway before the gateway's next microseconds (1 of 60 records lost in CI; 5 of 32
runs of the SIGKILL test under CPU load lost one). A filter that sets fields of the record late does so
in ``ctx.on_answer``, which runs before the row (a cascade's discarded tier). What it cannot save: a
change a request's closers make after its last write when the kill lands in between, and anything on a
machine that loses its page cache (power, kernel crash). Two designs measured and
left (docs/benchmarks.md section 12): a ``write`` per row cost 23-27 us of gateway CPU per request at
c=16 (ext4 stalls now and then: p99 56 us, max 2.5 ms per write); one ``write`` per event-loop
iteration lost 1 of 1,000 answered requests in one of two SIGKILL runs (the iteration's other
callbacks ran between the response and the row).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import operator
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from usefulwork.gateway.context import RequestContext

if TYPE_CHECKING:
    from usefulwork.config import LedgerCfg

log = logging.getLogger("usefulwork.journal")

ROTATE_S = 30.0  # a new segment this often (old ones are deleted once acknowledged)
SEGMENT_BYTES = 16 << 20  # a segment's mapped size (a sparse file: only what is written takes disk); full -> next
ACK_CHUNK = 10_000  # ids per ack line
ADOPT_EVERY_S = 5.0  # how often a ledger looks for a dead process's journal
FIELDS = ("id", "client_request_id", "wall_start", "tenant", "endpoint", "model", "stream", "pool", "replica",
          "route", "route_reason", "escalated", "discarded_tokens", "discarded_cost_usd", "attempts", "cache",
          "saved_usd", "priority", "admission", "queue_ms", "shed_reason", "prompt_tokens", "completion_tokens",
          "cached_tokens", "usage_source", "status_code", "outcome", "error")
TIMES = ("t_validated", "t_forwarded", "t_first_token", "t_end")  # seconds after t_start
_ACK = b'["ack",'


def default_dir(jsonl_path: str | None, redis_url: str | None, redis_stream: str, cache_dir: Path) -> Path:
    """One directory per set of sinks: gateways writing the same ledger share it (workers, replicas on a
    host), and never take records meant for another ledger (the loadtest's profiles write theirs side by
    side). Gateways with ledgers of their own that should cover for each other set one ``journal_dir``."""
    jsonl = str(Path(jsonl_path).resolve()) if jsonl_path else ""
    digest = hashlib.sha256(f"{jsonl}\n{redis_url}\n{redis_stream}".encode()).hexdigest()[:16]
    if jsonl_path:
        return Path(jsonl).parent / ".usefulwork-journal" / digest
    return cache_dir / "journal" / digest


def journal_dir_for(ledger: LedgerCfg) -> Path | None:
    """Where a gateway with these ledger settings journals (None: no sink to journal for, or the journal is
    off): ``ledger.journal_dir``, else ``default_dir``. What the accounting builds and preflight checks."""
    if not (ledger.jsonl_path or ledger.redis_url) or not ledger.journal:
        return None
    if ledger.journal_dir:
        return Path(ledger.journal_dir)
    from usefulwork.embedding import cache_dir  # noqa: PLC0415 (only for a ledger without a JSONL file)

    return default_dir(ledger.jsonl_path, ledger.redis_url, ledger.redis_stream, cache_dir(None))


_fields = operator.attrgetter(*FIELDS)


def _row(ctx: RequestContext, fields: tuple) -> bytes:
    t0, tv, tf, t1, te = ctx.t_start, ctx.t_validated, ctx.t_forwarded, ctx.t_first_token, ctx.t_end
    return orjson.dumps((*fields, None if tv is None else tv - t0, None if tf is None else tf - t0,
                         None if t1 is None else t1 - t0, None if te is None else te - t0))


def _context(row: list) -> RequestContext:
    """A finished request rebuilt from its journal row (``t_start`` = 0, the other times relative)."""
    ctx = RequestContext(id=row[0], endpoint=row[4], model=row[5], stream=row[6])
    for name, value in zip(FIELDS, row):
        setattr(ctx, name, value)
    ctx.t_start = 0.0
    for name, value in zip(TIMES, row[len(FIELDS):]):
        setattr(ctx, name, value)
    ctx.recovered = True
    return ctx


class Journal:
    """This process's journal (see the module doc). ``append`` runs on the request path."""

    def __init__(self, directory: str | os.PathLike[str], rotate_s: float = ROTATE_S):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rotate_s = rotate_s
        self.tag = f"{os.getpid()}-{time.time_ns():x}"
        # locked under a temporary name, then renamed: a scanner never sees an unlocked lock file of a live process
        tmp = self.dir / f".{self.tag}.lock.tmp"
        self._lock_fd = os.open(tmp, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        os.rename(tmp, self.dir / f"{self.tag}.lock")
        self._seg = -1
        self._map: mmap.mmap | None = None
        self._off = 0
        self._opened = 0.0
        self._segments: dict[int, int] = {}  # segment -> requests not yet acknowledged
        self._seg_of: dict[str, int] = {}  # request id -> its segment
        self._open_segment()

    def _path(self, seg: int) -> Path:
        return self.dir / f"{self.tag}.{seg}.jsonl"

    def _open_segment(self) -> None:
        if self._map is not None:
            self._map.close()
        self._seg += 1
        self._segments[self._seg] = 0
        fd = os.open(self._path(self._seg), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, SEGMENT_BYTES)
            self._map = mmap.mmap(fd, SEGMENT_BYTES)  # MAP_SHARED: written bytes are the file's page cache
        finally:
            os.close(fd)
        self._off = 0
        self._opened = time.monotonic()

    # -- the request path --
    def append(self, ctx: RequestContext) -> None:
        """Journal the request as it stands, unless its last row already says so (times aside).

        Runs twice per request: as its response's last bytes are handed to the socket (before them: a
        client holding the whole answer never outruns its row) and when it finishes, where it writes
        again only if something a record shows changed in between (a cascade's closer booking the
        discarded tier, a write that failed). A later row of the same id replaces the earlier one."""
        fields = _fields(ctx)
        if fields == ctx.journaled:
            return
        self._write(_row(ctx, fields) + b"\n")
        ctx.journaled = fields
        seg = self._seg
        old = self._seg_of.get(ctx.id)
        if old is not None:
            self._segments[old] -= 1
        self._seg_of[ctx.id] = seg
        self._segments[seg] += 1

    def _write(self, data: bytes) -> None:
        """Copy into the mapped segment (the kernel keeps it if the process dies); the next segment when full."""
        if self._map is None:
            return
        n = len(data)
        if self._off + n > SEGMENT_BYTES:
            self._open_segment()
        self._map[self._off:self._off + n] = data
        self._off += n

    # -- the ledger's background pass --
    def ack(self, ids: list[str]) -> None:
        """Every sink confirmed these records: note it, and delete segments with nothing left to recover."""
        known = [i for i in ids if i in self._seg_of]
        for k in range(0, len(known), ACK_CHUNK):
            self._write(_ACK + orjson.dumps(known[k:k + ACK_CHUNK]) + b"]\n")
        for i in known:
            self._segments[self._seg_of.pop(i)] -= 1
        if time.monotonic() - self._opened >= self.rotate_s:
            self._open_segment()
        self._drop_done()

    def _drop_done(self) -> None:
        # oldest first: a segment's ack lines may be what marks an older segment's requests as done
        for seg in sorted(self._segments):
            if seg == self._seg or self._segments[seg] > 0:
                return
            del self._segments[seg]
            self._path(seg).unlink(missing_ok=True)

    @property
    def pending(self) -> int:
        return len(self._seg_of)

    def close(self) -> None:
        """At a clean stop: delete everything if every record was acknowledged, else keep it for recovery."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if not self._seg_of:
            for seg in list(self._segments):
                self._path(seg).unlink(missing_ok=True)
            (self.dir / f"{self.tag}.lock").unlink(missing_ok=True)
        else:
            log.warning("ledger journal: %d records not confirmed by every sink; kept in %s for recovery",
                        len(self._seg_of), self.dir)
        os.close(self._lock_fd)  # releases the flock: a later gateway adopts what was kept

    # -- recovery --
    def adopt_orphans(self) -> list[RequestContext]:
        """Take the journals of dead processes in this directory: their unacknowledged requests are journaled
        here (before their files are deleted) and returned for the ledger to write."""
        out: list[RequestContext] = []
        for lock in self.dir.glob("*.lock"):
            tag = lock.name[:-len(".lock")]
            if tag == self.tag:
                continue
            try:
                fd = os.open(lock, os.O_RDWR)
            except FileNotFoundError:
                continue  # another gateway adopted it just now
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its process is alive
                if not lock.exists():
                    continue  # adopted and deleted between our glob and our lock
                ctxs = self._read(tag)
                for ctx in ctxs:
                    self.append(ctx)  # ours now (written): their own files can go
                for seg in self.dir.glob(f"{tag}.*.jsonl"):
                    seg.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
                if ctxs:
                    log.warning("ledger journal: recovered %d records of a gateway that died (%s)", len(ctxs), tag)
                out.extend(ctxs)
            finally:
                os.close(fd)
        return out

    def _read(self, tag: str) -> list[RequestContext]:
        rows: dict[str, list] = {}
        acked: set[str] = set()
        segs = sorted(self.dir.glob(f"{tag}.*.jsonl"), key=lambda p: int(p.name.rsplit(".", 2)[1]))
        for seg in segs:
            for line in seg.read_bytes().split(b"\0", 1)[0].splitlines():  # rows, then the map's zeros
                try:
                    row = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a torn line (a full disk): skipped, the others still count
                if row and row[0] == "ack":
                    acked.update(row[1])
                elif len(row) == len(FIELDS) + len(TIMES):
                    rows[row[0]] = row
        out = []
        for rid, row in rows.items():
            if rid not in acked:
                try:
                    out.append(_context(row))
                except Exception:  # noqa: BLE001 - a malformed row must not stop the others
                    log.exception("ledger journal: unreadable row in %s", tag)
        return out
