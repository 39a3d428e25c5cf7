"""The `cache` experiment's wiring: profiles change the gateway's config; the Q&A workload is cacheable."""

import numpy as np

from usefulwork.caches.config import CacheCfg
from usefulwork.caches.keys import uncacheable
from usefulwork.loadtest import workloads
from usefulwork.loadtest.experiment import gateway_config, load_experiment
from usefulwork.loadtest.gateway_stats import delta


def test_cache_on_profile_adds_the_filter_and_the_workload_is_cacheable():
    exp = load_experiment("cache")
    on = next(p for p in exp.profiles if p.name == "cache-on")
    off = next(p for p in exp.profiles if p.name == "cache-off")
    assert gateway_config(exp, on, "http://127.0.0.1:1", 2)["filters"] == ["cache"]
    assert "filters" not in gateway_config(exp, off, "http://127.0.0.1:1", 2)
    from pathlib import Path
    case = exp.case_for(exp.shapes[0], "qa-repeats")
    wl = workloads.from_spec(case.workload, Path(exp.source).parent)
    reqs = [r for r, _ in zip(wl.requests(np.random.default_rng(0)), range(200))]
    kinds = {r.kind for r in reqs}
    assert kinds == {"first", "repeat", "paraphrase", "unique"}
    assert all(uncacheable(r.body("m"), "chat", CacheCfg()) is None for r in reqs)


def test_gateway_window_reports_the_cache_figures():
    def snap(now, miss, hit, cpu):
        return {"now": now, "fleet": {"all": {"requests": miss + hit, "ok": miss + hit, "gpu": {"cost_usd": 1.0}}},
                "filters": {"cache": {"requests": {"miss": miss, "hit-exact": hit, "hit-semantic": 0, "bypass": 0},
                                      "saved_usd": hit * 0.01, "cpu_s": cpu, "embed_s": 0.0}}}
    d = delta(snap(0, 1, 1, 0.0), snap(10, 4, 5, 0.007))["cache"]
    assert d["hit_share"] == 4 / 7 and abs(d["cpu_ms_per_request"] - 1.0) < 1e-9 and abs(d["saved_usd"] - 0.04) < 1e-9
