"""The ledger's write-ahead journal (accounting/journal.py): what a dead process leaves is recovered once,
what was acknowledged is not, a live process's journal is never taken. The real SIGKILL is in
tests/e2e/test_reliability.py."""

from __future__ import annotations

import asyncio
import os

import orjson

from usefulwork.gateway.accounting.journal import Journal
from usefulwork.gateway.context import RequestContext


def _ctx(i: int) -> RequestContext:
    ctx = RequestContext(id=f"r{i}", endpoint="chat", model="m", stream=bool(i % 2), tenant=f"t{i % 3}")
    ctx.pool, ctx.replica, ctx.prompt_tokens, ctx.completion_tokens = "p", "http://r", 10 + i, 20 + i
    ctx.usage_source, ctx.status_code, ctx.outcome, ctx.priority = "backend", 200, "ok", "batch"
    ctx.t_validated, ctx.t_forwarded = ctx.t_start + 0.001, ctx.t_start + 0.002
    ctx.t_first_token, ctx.t_end = ctx.t_start + 0.1 * (i + 1), ctx.t_start + 0.5 * (i + 1)
    return ctx


def _die(j: Journal) -> None:
    """What a SIGKILL leaves: the files as written, the lock released (no close(), no clean-up)."""
    j._map.close()
    os.close(j._lock_fd)


def test_a_dead_process_leaves_its_unacknowledged_requests_and_another_recovers_them_once(tmp_path):
    dead = Journal(tmp_path)
    sent = [_ctx(i) for i in range(5)]
    for c in sent:
        dead.append(c)
    dead.ack(["r1", "r3"])  # every sink has these two
    _die(dead)

    heir = Journal(tmp_path)
    got = {c.id: c for c in heir.adopt_orphans()}
    assert set(got) == {"r0", "r2", "r4"}
    for c in sent:
        if c.id in got:
            r = got[c.id]
            assert r.recovered and (r.tenant, r.stream, r.prompt_tokens, r.completion_tokens, r.priority) == (
                c.tenant, c.stream, c.prompt_tokens, c.completion_tokens, c.priority)
            assert abs(r.ttft_ms - c.ttft_ms) < 1e-6 and abs(r.e2e_ms - c.e2e_ms) < 1e-6
            assert r.wall_start == c.wall_start
    # the dead process's files are gone; its requests are now the heir's own, journaled before the delete
    assert not list(tmp_path.glob(f"{dead.tag}*"))
    assert heir.pending == 3
    assert Journal(tmp_path).adopt_orphans() == []  # taken once, not twice


def test_a_live_processs_journal_is_never_taken(tmp_path):
    live = Journal(tmp_path)
    live.append(_ctx(0))
    assert Journal(tmp_path).adopt_orphans() == []
    assert live.pending == 1


def test_a_clean_close_with_everything_acknowledged_leaves_nothing_and_one_that_is_not_keeps_it(tmp_path):
    j = Journal(tmp_path)
    j.append(_ctx(0))
    j.ack(["r0"])
    j.close()
    assert list(tmp_path.iterdir()) == []
    k = Journal(tmp_path)
    k.append(_ctx(1))
    k.close()  # a sink never confirmed r1
    assert [c.id for c in Journal(tmp_path).adopt_orphans()] == ["r1"]


def test_segments_rotate_and_go_once_their_requests_and_every_older_ones_are_acknowledged(tmp_path):
    j = Journal(tmp_path, rotate_s=0.0)
    j.append(_ctx(0))
    j.ack([])  # rotates: segment 0 holds r0
    j.append(_ctx(1))
    j.ack(["r1"])  # segment 1's request acknowledged, but segment 0's is not: both stay
    assert len(list(tmp_path.glob(f"{j.tag}.*.jsonl"))) == 3
    j.ack(["r0"])
    assert [p.name for p in tmp_path.glob(f"{j.tag}.*.jsonl")] == [f"{j.tag}.{j._seg}.jsonl"]
    _die(j)
    assert Journal(tmp_path).adopt_orphans() == []


def test_a_row_is_written_when_its_request_finishes(tmp_path):
    j = Journal(tmp_path)
    for i in range(3):
        j.append(_ctx(i))
        rows = (tmp_path / f"{j.tag}.0.jsonl").read_bytes().split(b"\0", 1)[0].splitlines()
        assert len(rows) == i + 1  # in the file (its page cache) at once, from another reader's view
    j.close()


async def test_a_request_is_journaled_before_its_last_response_bytes_are_written(tmp_path):
    """A SIGKILL sent as soon as the client had its whole answer lost that request's record (CI, session
    45: 1 of 60 in tests/e2e/test_reliability.py): its row was written after the response's last write,
    and the OS may run the woken client, which sends the kill, before the gateway's next microseconds.
    Now the row is in the file when the last bytes (a body, a stream's end event, a shed's 429) go out.
    The stream goes through the real forwarder: its usage event comes just before the end event, and the
    row at the end event holds it (before, the reply took it only when the relay ended, after that write)."""
    from tests.gateway.accounting.test_ledger import make_accountant
    from tests.gateway.test_proxy import CHAT, Client
    from tests.upstream.test_forwarder import Canned, fleet_of, sse
    from usefulwork.gateway.errors import GatewayError
    from usefulwork.gateway.pipeline import Reply
    from usefulwork.gateway.proxy import Endpoint, Intake
    from usefulwork.gateway.tenants import Tenants
    from usefulwork.upstream.forwarder import Forwarder
    from usefulwork.upstream.pickers import build_pickers

    usage = {"prompt_tokens": 7, "completion_tokens": 2}
    async with Canned(sse([b'{"choices":[{"delta":{"content":"a"}}]}', b'{"choices":[],"usage":'
                           + orjson.dumps(usage) + b'}'])) as upstream:
        fleet = fleet_of(upstream.url)
        forward = Forwarder(fleet, build_pickers(fleet.cfg, fleet))

        async def handler(call):
            kind = call.ctx.client_request_id
            if kind in ("late", "stream-late"):  # a filter that sets a field of the record at the end (a cascade's)
                call.ctx.on_answer = lambda: setattr(call.ctx, "discarded_tokens", call.ctx.prompt_tokens + 5)
            if kind == "shed":
                raise GatewayError(429, "over capacity", code="shed", headers=[(b"retry-after", b"3")])
            if kind.startswith("stream"):
                call.ctx.stream, call.pool = True, fleet.pool_for_model("m")
                return await forward(call)
            return Reply(200, [(b"content-type", b"application/json")], body=b'{"ok":1}', usage=usage)

        acc = make_accountant(sinks=[_Flaky()], journal_dir=tmp_path)[0]  # the sink refuses: nothing is acked
        await acc.start()
        ep = Endpoint(Intake(acc.fleet, acc, Tenants(acc.cfg), handler, max_body=1 << 20, body_timeout_s=5), CHAT)
        kinds = (("unary", 200, "ok"), ("stream", 200, "ok"), ("shed", 429, "shed"), ("late", 200, "ok"),
                 ("stream-late", 200, "ok"))
        for kind, status, outcome in kinds:
            seen: list[list | None] = []
            c = Client(b'{"model":"s","messages":[{"role":"user","content":"hi"}]}', [(b"x-request-id", kind.encode())])
            send = c.send

            async def watch(msg, c=c, send=send, seen=seen):
                if msg["type"] == "http.response.body" and (not msg.get("more_body") or b"[DONE]" in msg["body"]):
                    start = next(m for m in c.sent if m["type"] == "http.response.start")
                    rid = dict(start["headers"])[b"x-request-id"]
                    # what a gateway adopting this journal would read from the files now
                    seen.append({r.id: r for r in acc.journal._read(acc.journal.tag)}.get(rid.decode()))
                await send(msg)

            await ep(c.scope, c.receive, watch)
            assert c.status == status and seen and all(seen), f"{kind}: a last write went out before its row"
            r = seen[0]
            assert (r.client_request_id, r.status_code, r.outcome) == (kind, status, outcome)
            if status == 200:
                assert (r.prompt_tokens, r.completion_tokens) == (7, 2)
            assert r.discarded_tokens == (12 if kind.endswith("late") else 0)  # (set in ctx.on_answer: in the row)
        lines = b"".join(p.read_bytes().split(b"\0", 1)[0] for p in tmp_path.glob("*.jsonl")).splitlines()
        assert acc.journal.pending == 5 and len(lines) == 5  # one row each: the finish found nothing changed
        await acc.stop()
        await fleet.stop()


class _Flaky:
    """A sink that refuses writes until told otherwise."""

    name = "flaky"

    def __init__(self) -> None:
        self.ok = False
        self.records: list[bytes] = []

    async def write(self, batch: list[bytes]) -> None:
        if not self.ok:
            raise ConnectionError("down")
        self.records.extend(batch)

    async def close(self) -> None:
        return None


async def test_the_ledger_acknowledges_only_what_every_sink_has_and_a_bad_directory_turns_the_journal_off(tmp_path):
    from tests.gateway.accounting.test_ledger import T0, Clock, ctx_at, make_accountant

    sink = _Flaky()

    def ledger(journal_dir):
        return make_accountant(clock=Clock(T0 + 5), sinks=[sink], journal_dir=journal_dir)[0]

    acc = ledger(tmp_path / "j")
    await acc.start()
    for i in range(3):  # no GPU work: written at once, if the sink takes them
        acc.finish(ctx_at(T0 + i, pool=None, prompt=0, completion=0, outcome="shed", status_code=429))
    await asyncio.sleep(0.3)
    assert acc.journal.pending == 3 and sink.records == []  # the sink refused them: still the journal's
    sink.ok = True
    await asyncio.sleep(0.3)
    assert len(sink.records) == 3 and acc.journal.pending == 0
    await acc.stop()
    assert list((tmp_path / "j").iterdir()) == []

    (tmp_path / "file").write_text("not a directory")
    acc = ledger(tmp_path / "file" / "j")
    await acc.start()  # logged, not raised: the gateway serves without a journal
    assert acc.journal is None
    acc.finish(ctx_at(T0, pool=None, prompt=0, completion=0, outcome="shed", status_code=429))
    await acc.stop()
    assert len(sink.records) == 4


async def test_records_dropped_from_a_failing_sinks_memory_stay_in_the_journal(tmp_path, monkeypatch):
    from tests.gateway.accounting.test_ledger import T0, Clock, ctx_at, make_accountant
    from usefulwork.gateway.accounting import ledger as ledger_mod

    monkeypatch.setattr(ledger_mod, "MAX_BACKLOG", 2)
    sink = _Flaky()
    acc = make_accountant(clock=Clock(T0 + 5), sinks=[sink], journal_dir=tmp_path)[0]
    await acc.start()
    for i in range(5):
        acc.finish(ctx_at(T0 + i, pool=None, prompt=0, completion=0, outcome="shed", status_code=429))
    await asyncio.sleep(0.3)
    assert acc.records_dropped == 3
    sink.ok = True
    await asyncio.sleep(0.3)
    assert len(sink.records) == 2 and acc.journal.pending == 3  # the three dropped ones are not acknowledged
    await acc.stop()
    heir = Journal(tmp_path)
    assert len(heir.adopt_orphans()) == 3  # a later gateway writes them


def test_gateways_share_a_journal_only_when_they_write_the_same_ledger(tmp_path):
    from usefulwork.gateway.accounting.journal import default_dir

    a = default_dir(str(tmp_path / "ledger-a.jsonl"), None, "s", tmp_path / "cache")
    assert a == default_dir(str(tmp_path / "." / "ledger-a.jsonl"), None, "s", tmp_path / "cache")
    assert a != default_dir(str(tmp_path / "ledger-b.jsonl"), None, "s", tmp_path / "cache")  # side by side
    assert a.parent == tmp_path / ".usefulwork-journal"
    r = default_dir(None, "redis://h:6379/0", "usefulwork:ledger", tmp_path / "cache")
    assert r.parent == tmp_path / "cache" / "journal"
    assert r != default_dir(None, "redis://h:6379/0", "other", tmp_path / "cache")
