"""`usefulwork replay`: reading logs (bad lines skipped with their line number), the Mooncake export, and
end to end: real traffic through a real gateway (record filter) in front of the simulator, replayed
(plain and redacted), an unreachable target, and Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port
from tests.e2e.conftest import pool_cfg, start_gateway
from usefulwork.backends.sim.process import SimProcess
from usefulwork.cli import main as cli_main
from usefulwork.loadtest.replay import load_workload, read_log, to_mooncake
from usefulwork.loadtest.traces import parse_mooncake

MODEL = "Llama-3.1-8B"


def rec(ts: float, **kw) -> dict:
    return {"v": 1, "ts": ts, "op": "completions", "tenant": "t", "outcome": "ok", "prompt_tokens": 600,
            "completion_tokens": 8, "body": {"model": MODEL, "prompt": "hi", "max_tokens": 8}, **kw}


def test_bad_lines_are_reported_with_their_line_number_and_skipped(tmp_path):
    log = tmp_path / "t.jsonl"
    log.write_text(json.dumps(rec(1.0)) + "\n" + "not json\n" + json.dumps({"ts": "x", "op": "chat"}) + "\n"
                   + json.dumps(rec(2.0)) + "\n" + '{"v": 1, "ts": 3.0, "op": "comp')  # truncated last line
    out = read_log(log)
    assert len(out.records) == 2
    assert [p.split(": ")[0] for p in out.problems] == [f"{log}:2", f"{log}:3", f"{log}:5"]
    assert "truncated" in out.problems[2]


def test_a_log_directory_is_read_in_rotation_order(tmp_path):
    (tmp_path / "traffic-1.jsonl").write_text(json.dumps(rec(1.0)) + "\n")
    (tmp_path / "traffic-2.jsonl").write_text(json.dumps(rec(2.0, op="embeddings")) + "\n")
    wl, log = load_workload(tmp_path)
    assert len(log.records) == 2 and len(wl.records) == 1 and wl.skipped == 1


def test_mooncake_export_reads_back_and_keeps_shared_prefixes():
    recs = [rec(10.0, hash_ids=[111, 222]), rec(10.5, hash_ids=[111, 333], prompt_tokens=900)]
    rows = to_mooncake(recs)
    assert rows[0] == {"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [0, 1]}
    assert rows[1]["timestamp"] == 500 and rows[1]["hash_ids"] == [0, 2]
    parsed = parse_mooncake("\n".join(json.dumps(r) for r in rows), "x")
    assert [p.input_tokens for p in parsed] == [600, 900]


@pytest.mark.parametrize("mode", ["target", "paired"])
def test_an_unreachable_target_is_a_clear_error_and_bad_lines_are_printed(tmp_path, capsys, mode):
    log = tmp_path / "t.jsonl"
    log.write_text(json.dumps(rec(1.0)) + "\n" + '{"v": 1, "ts": 2.0, "op": "comp\n')
    dead = f"http://127.0.0.1:{free_port()}"
    urls = ["--target", dead] if mode == "target" else ["--baseline", dead, "--candidate", dead]
    rc = cli_main(["replay", str(log), *urls])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unreachable" in err and dead in err and "Traceback" not in err
    assert f"{log}:2: not valid JSON (truncated?)" in " ".join(err.split())  # the skipped line, by number


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A sim behind a recording gateway, and a log of real loadtest traffic through it."""
    tmp = tmp_path_factory.mktemp("replay")
    sim = SimProcess(port=free_port(), gpu="A100-80G", model=MODEL, time_scale=20.0, log_path=tmp / "sim.log")
    sim.start()
    sim.wait_ready(120)
    gw = start_gateway(tmp, pool_cfg(MODEL, [sim.base_url], filters=["record"],
                                     record={"dir": str(tmp / "traffic"), "flush_interval_s": 0.05},
                                     auth={"api_keys": {"k1": "acme"}}))
    try:
        rc = cli_main(["loadtest", "--url", gw.url, "--model", MODEL, "--api-key", "k1", "--prompt-tokens", "700",
                       "--output-tokens", "16", "--arrival", "poisson", "--rate", "8", "--duration", "4",
                       "--out", str(tmp / "lt.json")])
        assert rc == 0
        time.sleep(0.3)  # the drain runs every 50 ms
        yield gw, tmp
    finally:
        gw.stop()
        sim.stop()


def test_recorded_traffic_replays_against_the_same_gateway(recorded, tmp_path):
    gw, tmp = recorded
    log = read_log(tmp / "traffic")
    sent = json.loads((tmp / "lt.json").read_text())["num_prompts"]
    assert len(log.records) == sent and not log.problems
    assert {r["tenant"] for r in log.records} == {"acme"} and all(r["outcome"] == "ok" for r in log.records)
    out = tmp_path / "rep.json"
    rc = cli_main(["replay", str(tmp / "traffic"), "--target", gw.url, "--api-key", "k1", "--speed", "2",
                   "--out", str(out), "--html", str(tmp_path / "rep.html")])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == sent and r["total_output_tokens"] == 16 * sent
    assert r["recorded"]["p50_e2el_ms"]["recorded"] > 0 and "<img" in (tmp_path / "rep.html").read_text()


def test_a_redacted_log_replays_with_synthetic_text_of_the_recorded_lengths(recorded, tmp_path):
    gw, tmp = recorded
    redacted = tmp_path / "redacted.jsonl"
    with redacted.open("w") as f:  # what record.redact writes: no body, lengths and block hashes
        for r in read_log(tmp / "traffic").records:
            r.pop("body"), r.pop("_line")
            f.write(json.dumps(r) + "\n")
    out = tmp_path / "rep.json"
    assert cli_main(["replay", str(redacted), "--target", gw.url, "--api-key", "k1", "--speed", "4",
                     "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["outcome_counts"]["ok"] == r["num_prompts"]
    recorded_in = [x["prompt_tokens"] for x in read_log(redacted).records]
    for got, want in zip(r["input_lens"], recorded_in):
        assert abs(got - want) <= 0.2 * want


def test_ctrl_c_writes_what_it_has(recorded, tmp_path):
    gw, tmp = recorded
    out = tmp_path / "partial.json"
    proc = subprocess.Popen([sys.executable, "-m", "usefulwork.cli", "replay", str(tmp / "traffic"), "--target",
                             gw.url, "--api-key", "k1", "--speed", "0.5", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(4.0)  # a few requests in (the log spans ~4 s; at speed 0.5 the replay takes ~8 s)
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 130, text
    r = json.loads(out.read_text())
    assert r["interrupted"] is True and 0 < r["num_prompts"] < len(read_log(tmp / "traffic").records)
    assert "interrupted" in text and "Traceback" not in text


def test_real_vllm_traffic_recorded_by_the_sdk_replays(vllm_server, tmp_path):
    """The real openai SDK through a recording gateway in front of real vLLM; the log replays against it."""
    import openai

    gw = start_gateway(tmp_path, pool_cfg(vllm_server.model, [vllm_server.base_url], filters=["record"],
                                          record={"dir": str(tmp_path / "traffic"), "flush_interval_s": 0.05}))
    try:
        c = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120)
        c.chat.completions.create(model=vllm_server.model, messages=[{"role": "user", "content": "Say hi."}],
                                  max_tokens=8)
        with c.chat.completions.create(model=vllm_server.model, max_tokens=8, stream=True,
                                       messages=[{"role": "user", "content": "Count to three."}]) as s:
            for _ in s:
                pass
        c.completions.create(model=vllm_server.model, prompt="The sky is", max_tokens=8)
        time.sleep(0.3)
        recs = read_log(tmp_path / "traffic").records
        assert [(r["op"], r["stream"]) for r in recs] == [("chat", False), ("chat", True), ("completions", False)]
        assert all(r["outcome"] == "ok" and r["usage_source"] == "backend" and r["completion_tokens"] > 0
                   and r["prompt_tokens"] > 0 and r["e2e_ms"] >= r["ttft_ms"] > 0 for r in recs)
        out = tmp_path / "rep.json"
        assert cli_main(["replay", str(tmp_path / "traffic"), "--target", gw.url, "--speed", "4",
                         "--out", str(out)]) == 0
        r = json.loads(out.read_text())
        assert r["completed"] == 3 and r["input_lens"] == [x["prompt_tokens"] for x in recs]
    finally:
        gw.stop()
