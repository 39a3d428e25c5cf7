"""JSON results of a run, shaped like ``vllm bench serve``'s saved JSON where the two overlap.

Top level of one run: vLLM's setup keys (``date``, ``backend``, ``label``, ``model_id``,
``num_prompts``, ``request_rate``, ``burstiness``, ``max_concurrency``), vLLM's result keys
(``duration``, ``completed``, ``failed``, ``*_throughput``, ``mean_/median_/std_/pNN_{ttft,tpot,itl,e2el}_ms``,
``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``latencies``, ``start_times``, ``errors``,
``max_concurrent_requests``, ``max_output_tokens_per_s``), then ours: ``outcomes``, ``dropped``,
``good``, ``slo``, ``slo_pass_rate``, ``slo_passed``, cost figures, schedule lag, ``timeline``,
``load``, ``workload``, ``target`` and, when a gateway was measured, ``gateway``.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from usefulwork.loadtest.metrics import SLOSpec, per_request_arrays, summarize, timeline
from usefulwork.loadtest.runner import RunOutput


def run_result(out: RunOutput, *, slo: SLOSpec, usd_per_hour: float, label: str = "") -> dict[str, Any]:
    arrival = out.load.get("arrival") or {}
    chat = out.workload.get("type") in ("realistic", "jsonl") or out.workload.get("endpoint") == "chat"
    backend = "openai-chat" if chat else "openai"
    summary = summarize(out.results, slo=slo, usd_per_hour=usd_per_hour)
    tl = timeline(out.results)
    result: dict[str, Any] = {
        "date": datetime.fromtimestamp(out.wall_start, timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": backend,
        "label": label,
        "model_id": out.target["model"],
        "num_prompts": len(out.results),
        "request_rate": arrival.get("rate", _mean_rate(arrival)) if arrival else "inf",
        "burstiness": arrival.get("burstiness", 1.0) if arrival else 1.0,
        "max_concurrency": out.load.get("concurrency"),
    }
    result.update(summary)
    result["max_output_tokens_per_s"] = max(tl["output_tokens_per_s"], default=0.0)
    result.update(per_request_arrays(out.results))
    result.update({
        "wall_start": out.wall_start,
        "wall_end": out.wall_end,
        "timeline": tl,
        "load": out.load,
        "workload": out.workload,
        "target": out.target,
        "generator": out.generator,
    })
    return result


def _mean_rate(arrival: dict[str, Any]) -> float | str:
    if arrival.get("process") == "onoff":
        return arrival["peak_rate"] * arrival["duty"] + arrival["base_rate"] * (1 - arrival["duty"])
    return "inf"


def write_json(path: str | Path, data: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=1, default=str))
    return p


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())
