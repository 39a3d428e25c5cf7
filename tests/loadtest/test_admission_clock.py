"""The virtual-clock cells' floor for a quiet tenant's first tokens (loadtest/admission_clock.py)."""

from __future__ import annotations

from usefulwork.gateway.admission.config import AdmissionCfg
from usefulwork.loadtest import admission_clock


def test_the_floor_is_under_every_first_token_served_and_over_one_prompt_alone():
    """The floor prices each quiet request at the API front-end, the rest of the step in progress (cut to
    one prompt's prefill) and one prompt's prefill step: every first token actually served took at least
    that, so the floor's p99 is at most the served p99; and it is never under the front-end and one
    prefill step. Seed 1 of the fairness cell: a quiet prompt often reaches the engine in the middle of a
    heavy prompt's prefill, so the floor is above the 1.2x target for at least one quiet tenant."""
    cell = admission_clock.arrivals(admission_clock.FAIRNESS_MIX, 24.0, 30.0, seed=1)
    quiet = {"q1", "q2", "q3"}
    loaded = admission_clock.run(cell, AdmissionCfg(), 30.0)
    alone = admission_clock.run(admission_clock.only(cell, quiet), AdmissionCfg(), 30.0)
    assert loaded.front_end_s > 0 and loaded.steps
    ratios = []
    for q in sorted(quiet):
        floor = admission_clock.floor_p99(loaded, alone, q)
        one = min(p[2] for p in alone.parts[q])
        assert loaded.front_end_s + one <= floor <= loaded.p99(q), (q, floor, loaded.p99(q))
        assert len(loaded.arrived[q]) == len(loaded.ttft[q])  # none shed: each arrival has its first token
        ratios.append(floor / alone.p99(q))
    assert max(ratios) > 1.2, ratios
