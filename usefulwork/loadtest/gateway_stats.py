"""The gateway's own ledger figures for the window of a load run, next to the load generator's.

``GET /usefulwork/stats`` (docs/accounting.md) gives running totals since the gateway started
(``fleet.all``). A snapshot just before the run starts and one after the last request was
counted give the gateway's counts and GPU cost for (almost exactly) the run's window; the two
views must agree, and ``compare`` reports by how much they do not.

Outcome names differ on purpose: a request the load generator gave up on (``timeout``) is a
``client_cancelled`` for the gateway (the client went away); both count as not-ok.
"""

from __future__ import annotations

import time
from typing import Any

import httpx


def fetch(base_url: str, timeout_s: float = 5.0, api_key: str | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None  # the admin key, where keys exist
    r = httpx.get(f"{base_url}/usefulwork/stats", timeout=timeout_s, headers=headers)
    r.raise_for_status()
    return r.json()


def _all(snapshot: dict[str, Any]) -> dict[str, Any]:
    return snapshot["fleet"]["all"]


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Gateway figures between two snapshots (running totals subtracted)."""
    a, b = _all(before), _all(after)
    keys = ("requests", "ok", "good", "shed", "error", "timeout", "client_cancelled", "rejected", "dropped",
            "prompt_tokens", "completion_tokens", "generated_tokens_ok")
    d: dict[str, Any] = {k: (b.get(k) or 0) - (a.get(k) or 0) for k in keys}
    cost = (b["gpu"]["cost_usd"] or 0.0) - (a["gpu"]["cost_usd"] or 0.0)
    d["window_s"] = after["now"] - before["now"]
    d["cost_usd"] = cost
    d["usd_per_1k_successful"] = cost / d["ok"] * 1e3 if d["ok"] else None
    d["usd_per_1k_good"] = cost / d["good"] * 1e3 if d["good"] else None
    d["usd_per_1m_generated_tokens"] = cost / d["generated_tokens_ok"] * 1e6 if d["generated_tokens_ok"] else None
    d["fleet_usd_per_hour"] = sum(p.get("usd_per_hour", 0.0) for p in after.get("pools", {}).values())
    cache_a, cache_b = (before.get("filters") or {}).get("cache"), (after.get("filters") or {}).get("cache")
    if cache_a and cache_b:  # the cache filter's figures for the window (docs/caching.md)
        seen = {k: cache_b["requests"][k] - cache_a["requests"].get(k, 0) for k in cache_b["requests"]}
        n = sum(seen.values())
        hits = seen.get("hit-exact", 0) + seen.get("hit-semantic", 0)
        d["cache"] = {"requests": seen, "hit_share": hits / n if n else None,
                      "saved_usd": cache_b["saved_usd"] - cache_a["saved_usd"],
                      "cpu_ms_per_request": (cache_b["cpu_s"] - cache_a["cpu_s"]) * 1e3 / n if n else None,
                      "embed_ms_per_request": (cache_b["embed_s"] - cache_a["embed_s"]) * 1e3 / n if n else None}
    return d


def _pct(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or ours == 0:
        return None
    return (theirs - ours) / ours * 100.0


def compare(result: dict[str, Any], gw: dict[str, Any], time_scale: float = 1.0) -> dict[str, Any]:
    """Side by side: the load generator's figures, the gateway's, and the relative difference (%).

    ``time_scale``: the gateway measures wall seconds; results of a scaled-time simulator are in
    simulated seconds (wall x time_scale), so the gateway's window is shown scaled the same way.
    """
    rows = {
        "requests": (result["num_prompts"], gw["requests"]),
        "ok": (result["completed"], gw["ok"]),
        "good": (result["good"], gw["good"]),
        "generated_tokens": (result["total_output_tokens"], gw["generated_tokens_ok"]),
        "window_s": (result["duration"], gw["window_s"] * time_scale),
        "cost_usd": (result["cost_usd"], gw["cost_usd"]),
        "usd_per_1k_successful": (result["usd_per_1k_successful"], gw["usd_per_1k_successful"]),
        "usd_per_1k_good": (result["usd_per_1k_good"], gw["usd_per_1k_good"]),
        "usd_per_1m_generated_tokens": (result["usd_per_1m_generated_tokens"], gw["usd_per_1m_generated_tokens"]),
    }
    return {k: {"loadtest": a, "gateway": b, "diff_pct": _pct(a, b)} for k, (a, b) in rows.items()}


class StatsWindow:
    def __init__(self, base_url: str, time_scale: float = 1.0, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.time_scale = time_scale
        self.before: dict[str, Any] | None = None
        self.error: str | None = None

    def begin(self) -> None:
        try:
            self.before = fetch(self.base_url, api_key=self.api_key)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.error = f"GET /usefulwork/stats failed: {exc}"

    def end(self, result: dict[str, Any], settle_s: float = 3.0, behind_s: float = 30.0) -> dict[str, Any]:
        """Wait until the gateway has counted every request of the run, then compare.

        Requests the gateway has not finished yet (a cancel it has not seen) get ``settle_s``. Past
        that it waits, up to ``behind_s``, only while its ledger is behind: requests it finished but
        has not yet counted. A ledger pass can take seconds: the first stream cut short loads the
        model's tokenizer to count its tokens (1-3 s on a busy 2-core host), and every record
        finished meanwhile waits behind it. A request that never reached the gateway (a connect
        error) is never counted: the window then closes after ``settle_s``, not ``behind_s``.
        """
        if self.before is None:
            return {"error": self.error or "no snapshot before the run"}
        t0 = time.monotonic()
        while True:
            try:
                after = fetch(self.base_url, api_key=self.api_key)
                gw = delta(self.before, after)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                return {"error": f"GET /usefulwork/stats failed: {exc}"}
            behind = uncounted(self.before, after, gw)
            waited = time.monotonic() - t0
            if gw["requests"] >= result["num_prompts"] or waited >= behind_s or (waited >= settle_s and not behind):
                break
            time.sleep(0.2)
        if behind:
            gw["uncounted"] = behind  # finished by the gateway, not yet in its figures when the window closed
        out = {"figures": gw, "compare": compare(result, gw, self.time_scale)}
        if after.get("filters"):
            out["filters"] = after["filters"]  # e.g. admission's limit, queues and sheds at the cell's end
        return out


def uncounted(before: dict[str, Any], after: dict[str, Any], gw: dict[str, Any]) -> int:
    """Requests the gateway finished in the window that its figures do not count yet (its ledger's backlog)."""
    fa, fb = (before.get("ledger") or {}).get("finished"), (after.get("ledger") or {}).get("finished")
    if fa is None or fb is None:  # a gateway that does not say: nothing to wait for
        return 0
    return max(0, (fb - fa) - gw["requests"])
