"""The catalog's H100/H200 efficiencies are what benchmarks/gpu_roofline.py fits to the committed
timings of the real cards, and the fitted roofline keeps its held-out decode and prefill steps close."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_roofline
from usefulwork.backends.sim.catalog import gpu_spec

BENCH = Path(__file__).resolve().parents[3] / "docs" / "bench"


@pytest.mark.parametrize("gpu,card", [("H200", "h200"), ("H100-SXM", "h100")])
def test_catalog_holds_the_factors_fitted_to_the_real_card(tmp_path: Path, gpu: str, card: str):
    out = tmp_path / "fit.json"
    assert gpu_roofline.main(["fit", str(BENCH / f"gpu-roofline-{card}-raw.json"), "--gpu", gpu, "--json", str(out)]) == 0
    fit = json.loads(out.read_text())
    cal = gpu_spec(gpu).calibration
    assert fit["fitted"] == {"hbm_efficiency": cal.hbm_efficiency, "kv_efficiency": cal.kv_efficiency, "mfu": cal.mfu}
    rows = [r for r in fit["rows"] if r["calibration"] == "fitted"]
    small = [r for r in rows if r["decode_seqs"] <= 32 or (r["decode_seqs"] == 0 and r["prefills"] >= 4)]
    assert small and all(abs(r["error"]) <= 0.10 for r in small), small
