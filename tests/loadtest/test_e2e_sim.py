"""The experiment matrix end to end: simulator backends started per profile, a real gateway in
front, the gateway's ledger compared with the load generator's figures, the report written."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from tests.conftest import child_pids
from usefulwork.loadtest import experiment, report
from usefulwork.loadtest.experiment import ExperimentError, Options, load_experiment, run_experiment

TINY = """
name: tiny
backend:
  kind: sim
  gpu_name: A100-80G
  model: Llama-3.1-8B
  served_name: llama
  time_scale: 10
  gpu: {type: A100-80G, count: 1, usd_per_hour: 3.5}
slo: {ttft_ms: 2000, tpot_ms: 100, e2e_ms: 3000, attainment: 0.9}
profiles:
  naive-single: {sim_profile: naive-single, time_scale: 5}   # per-profile override
  optimized-batched: {sim_profile: optimized-batched}
cases:
  steady:
    arrival: {process: poisson, rate: 8}
    num_requests: 24
    timeout_s: 4
shapes:
  - {name: 128x32, prompt_tokens: 128, output_tokens: 32}
"""


def test_sim_matrix_through_gateway(tmp_path):
    f = tmp_path / "tiny.yaml"
    f.write_text(TINY)
    exp = load_experiment(str(f))
    data = run_experiment(exp, Options(out_dir=tmp_path, quiet=True), Console(quiet=True))
    cells = {c["profile"]: c["result"] for c in data["cells"]}
    naive, opt = cells["naive-single"], cells["optimized-batched"]
    assert naive["num_prompts"] == opt["num_prompts"] == 24
    # batching serves the burst of 24 within the SLO; one-at-a-time cannot
    assert opt["completed"] == 24 and opt["slo_passed"]
    assert naive["slo_passed"] is False and naive["p95_e2el_ms"] > opt["p95_e2el_ms"]
    assert opt["input_lens"] == [128] * 24 and opt["output_lens"] == [32] * 24
    # results are in simulated seconds (time scale 10): a 32-token answer takes > 0.3 s on an A100
    assert opt["mean_e2el_ms"] > 300
    assert data["ratios"][0]["ratio"] > 1.0
    for r in (naive, opt):
        gw = r["gateway"]["figures"]
        assert gw["requests"] == r["num_prompts"]
        if r is opt:  # nothing timed out: both ledgers must agree exactly
            assert gw["ok"] == r["completed"]
            assert gw["generated_tokens_ok"] == r["total_output_tokens"]
        else:
            late = _answered_before_the_client_left(r, tmp_path / "ledger-naive-single.jsonl")
            assert gw["ok"] == r["completed"] + len(late)
        # the gateway prices wall seconds at $/h x time scale: the simulated GPU's dollars
        wall_price = 3.5 * (5 if r is naive else 10)
        assert gw["fleet_usd_per_hour"] == pytest.approx(wall_price)
        assert gw["cost_usd"] == pytest.approx(wall_price * gw["window_s"] / 3600, rel=0.05)
        # its window brackets ours (snapshots just before the first send and after the last answer)
        assert r["gateway"]["compare"]["window_s"]["gateway"] >= r["duration"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["cells"]) == 2
    html_path = report.write_html(saved, tmp_path / "report.html")
    text = html_path.read_text()
    assert text.count("data:image/png;base64,") == 3 and "naive-single" in text


def _answered_before_the_client_left(result: dict, ledger: Path) -> list[str]:
    """Requests the client counted as timed out that the gateway booked as answered in full.

    The client's deadline cancels its read and closes the connection. When the load generator's own
    event loop runs late (a busy machine), its timer fires after a [DONE] already sitting in its
    socket; and the gateway, whose event loop learns of the close only on a later iteration, may
    write its last event in the same instant the client leaves. Either way the client counts a
    timeout while the gateway, which wrote [DONE] before it saw the client go, counts ok. Joined per
    request on x-request-id (the ledger's client_request_id), this must be the whole difference:
    every ok the client saw is ok in the ledger, and every ledger ok the client did not see is one of
    the client's own timeouts (never an error, a shed or a cut stream). No time tolerance is needed.
    """
    records = {rec["client_request_id"]: rec for rec in map(json.loads, ledger.read_text().splitlines())}
    stopped = json.loads((ledger.parent / "results.json").read_text()).get("timings", {}).get("naive-single", {})
    # every request the gateway saw is in its ledger (a clean stop writes everything it holds)
    assert len(records) == len(result["request_ids"]), stopped
    late = []
    for rid, outcome in zip(result["request_ids"], result["outcomes"]):
        rec = records[rid]
        if outcome == "ok":
            assert rec["outcome"] == "ok", rec
        elif rec["outcome"] == "ok":
            assert outcome == "timeout", (outcome, rec)
            late.append(rid)
    return late


def test_unknown_case_profile_and_bad_experiment_files(tmp_path):
    exp = load_experiment("cost")
    with pytest.raises(ExperimentError, match="unknown case 'nope'.*known: steady-cost-efficiency"):
        experiment.plan(exp, Options(cases=["nope"]))
    with pytest.raises(ExperimentError, match="unknown profile 'turbo'"):
        experiment.plan(exp, Options(profiles=["turbo"]))
    with pytest.raises(ExperimentError, match="unknown experiment 'nosuch'"):
        load_experiment("nosuch")
    f = tmp_path / "bad.yaml"
    f.write_text(TINY.replace("rate: 8", "rate: -1"))
    with pytest.raises(ExperimentError, match=r"bad.yaml: shape 128x32: case steady: arrival rate must be a positive"):
        load_experiment(str(f))
    f.write_text(TINY.replace("timeout_s: 4", "timeout_s: 4\n    colour: red"))
    with pytest.raises(ExperimentError, match="case steady: unknown field"):
        load_experiment(str(f))


def test_builtin_experiments_plan():
    cells = experiment.plan(load_experiment("cost"), Options())
    assert len(cells) == 8
    assert {(s["name"], c.name) for _, s, c in cells} == {
        (s, c) for s in ("512x128", "64x256") for c in ("steady-cost-efficiency", "burst-cost-efficiency")}
    a100 = load_experiment("cost-a100")
    assert a100.backend["kind"] == "sim" and len(experiment.plan(a100, Options())) == 4


def test_each_case_sends_prompts_of_its_own_so_a_backend_cache_does_not_carry_over(tmp_path):
    # One profile, two cases in turn on the same simulated server (prefix caching on, as vLLM's
    # default): with one seed for every cell the second cell re-sent the first one's prompts and was
    # served from the cache. Same case on another profile: the same requests (cells stay comparable).
    f = tmp_path / "two.yaml"
    f.write_text(TINY.replace("""cases:
  steady:""", """cases:
  again:
    arrival: {process: poisson, rate: 8}
    num_requests: 12
    timeout_s: 4
  steady:""").replace("  naive-single: {sim_profile: naive-single, time_scale: 5}   # per-profile override\n", ""))
    data = run_experiment(load_experiment(str(f)), Options(out_dir=tmp_path, quiet=True), Console(quiet=True))
    hits = [c["result"]["backends"]["prefix_hit_rate"] for c in data["cells"]]
    assert len(hits) == 2 and hits == [0.0, 0.0]
    # each cell says how late the simulator's steps ran (the host's share of its result; /sim/info)
    assert all(isinstance(c["result"]["backends"]["sim_lag_s"], float) for c in data["cells"])
    assert experiment.cell_seed(0, "128x32", "steady") != experiment.cell_seed(0, "128x32", "again")
    assert experiment.cell_seed(0, "128x32", "steady") != experiment.cell_seed(0, "512x128", "steady")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # reparented to init and not reaped yet: a zombie is gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_stops_the_backend_and_gateway_it_started(tmp_path):
    """A CI timeout or `kill` sends SIGTERM: the run must stop the servers it started (it left them running)."""
    f = tmp_path / "long.yaml"
    f.write_text(TINY.replace("num_requests: 24", "duration_s: 300"))
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "usefulwork.cli", "loadtest", "--experiment", str(f),
                                 "--out-dir", str(tmp_path / "out"), "--quiet"], stdout=subprocess.DEVNULL, stderr=err)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while "ready in" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        children += child_pids(proc.pid)
        assert len(children) >= 2, children  # the simulator and the gateway
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)], "left running after SIGTERM"
    finally:
        for p in [proc.pid, *children]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
