"""The admission queue's decision cost with many tenants contending (in process, no HTTP).

One pool (an SLO limit of 64), one heavy tenant holding 60 requests (over its fair share), and N quiet
tenants. Two phases, each timed per call, the best of ``--repeat`` runs (the host is shared: the best run is
the least disturbed):

- ``offer``: 2,000 arrivals from the quiet tenants in turn, each admitted, queued or shed, the oldest
  request released once 70 are in flight (what a tenant under its share costs to price while another
  is over its share);
- ``release``: every quiet tenant first queues three requests; then 300 releases, each refilling from
  the queues (``_pop_next`` looks at each tenant with work queued) and a new request for each one
  admitted.

    python benchmarks/admission_tenants.py --tenants 4,50,200 --repeat 5 [--priority]
    PYTHONPATH=/tmp/wt-old python benchmarks/admission_tenants.py    # another commit's queue, same script

``--priority``: the replicas schedule by priority, with the simulated A100 experiment's gates (three low-band
prompts per replica) and a decode speed and prefill time measured (20 ms a token, 50 ms a prompt): the prefill
gates, the turn and the pace (``PoolQueue.pace_free``) are priced too. No first token comes in either mode:
every admitted prompt stays pending (the heavy tenant's 60 are decoding: since session 68 a tenant alone is paced
by its turn, and with them pending it held one in the pool and queued the rest).

(``overhead.py`` measures the whole request path with one tenant, where none of this runs.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # (after PYTHONPATH: it may name another checkout)

from usefulwork.gateway.admission.capacity import Capacity  # noqa: E402
from usefulwork.gateway.admission.config import AdmissionCfg  # noqa: E402
from usefulwork.gateway.admission.queue import PoolQueue, Ticket  # noqa: E402


def _queue(priority: bool) -> PoolQueue:
    cfg = AdmissionCfg(initial_concurrency=64, low_band_prefills=3 if priority else 1)
    cap = Capacity(cfg, 2.0, 0.1, 5.0, replica_count=lambda: 1, priority_scheduling=priority)
    cap.service, cap.svc_ttft = 10.0, 0.1  # as if measured
    if priority:
        cap.tpot, cap.prefill_each = 0.02, 0.05
    q = PoolQueue.from_cfg("p", cap, cfg, 5.0)  # (the shipped settings, as the filter builds it)
    for _ in range(60):  # (each decoding: with its prompts pending, a tenant alone would be paced by its turn)
        q.offer(t := Ticket("heavy", 0, 640, 0.0, 1e6, max_tokens=None), 0.0)
        q.first_token(t, 0.0)
    assert len(q.running) == 60
    return q


def offers(tenants: int, priority: bool, n: int = 2000) -> float:
    """Microseconds per offer."""
    q, now = _queue(priority), 0.0
    running = list(q.running)
    t0 = time.perf_counter()
    for i in range(n):
        now += 0.001
        t = Ticket(f"q{i % tenants}", 0, 640, now, now + 100.0, max_tokens=None)
        q.offer(t, now)
        if t.state == "admitted":
            running.append(t)
        if len(running) > 70:
            running.extend(w for w in q.release(running.pop(0), now) if w.state == "admitted")
    return (time.perf_counter() - t0) / n * 1e6


def releases(tenants: int, priority: bool, n: int = 300) -> float:
    """Microseconds per release (its refills and their tenants' next requests included)."""
    q, now = _queue(priority), 0.0
    for i in range(tenants):
        for _ in range(3):
            q.offer(Ticket(f"q{i}", 0, 640, now, 1e6, max_tokens=None), now)
    running = list(q.running)
    done, t0 = 0, time.perf_counter()
    while done < n and running:
        now += 0.001
        for w in q.release(running.pop(0), now):
            running.append(w)
            t = Ticket(w.tenant, 0, 640, now, now + 1e6, max_tokens=None)
            q.offer(t, now)
            if t.state == "admitted":
                running.append(t)
        done += 1
    return (time.perf_counter() - t0) / max(1, done) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", default="4,50,200")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--priority", action="store_true", help="replicas scheduling by priority (see the module's text)")
    args = ap.parse_args()
    import usefulwork

    print(f"queue from {Path(usefulwork.__file__).parent}")
    print("| quiet tenants | us per offer | us per release |")
    print("|---:|---:|---:|")
    for k in (int(x) for x in args.tenants.split(",")):
        o = min(offers(k, args.priority) for _ in range(args.repeat))
        r = min(releases(k, args.priority) for _ in range(args.repeat))
        print(f"| {k} | {o:.1f} | {r:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
