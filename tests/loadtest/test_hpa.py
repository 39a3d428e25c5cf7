"""The HPA algorithm (usefulwork/loadtest/hpa.py) against the behaviour Kubernetes documents."""

from usefulwork.loadtest.hpa import HPA, SEED_DOWN, SEED_UP, Policy, Rules


def test_raw_recommendation_and_tolerance():
    h = HPA(1, 100, target=10.0)
    assert h.raw(4, 40.0) == 4  # exactly on target
    assert h.raw(4, 43.0) == 4  # ratio 1.075: within the 0.1 tolerance
    assert h.raw(4, 45.0) == 5  # ratio 1.125: ceil(45 / 10)
    assert h.raw(4, 35.0) == 4  # ratio 0.875: outside the tolerance, and ceil(35 / 10) = 4
    assert h.raw(4, 20.0) == 2
    assert h.raw(4, 0.0) == 0


def test_no_behavior_scales_up_at_once_bounded_by_the_default_policies():
    h = HPA(1, 100, target=10.0)
    assert h.sync(0.0, 2, 200.0) == 6  # wants 20; default policies: max(2 + 4 pods, 2 x 200%) per 15 s
    assert h.sync(5.0, 6, 200.0) == 6  # both spent within their 15 s period
    assert h.sync(15.0, 6, 200.0) == 12  # a new period: max(6 + 4, 6 x 2)


def test_seed_behavior_waits_60s_then_adds_2_pods_per_120s():
    h = HPA(2, 8, target=50.0, up=SEED_UP, down=SEED_DOWN)
    replicas, t, seen = 2, 0.0, []
    h.sync(t, replicas, 0.0)
    while t < 400:
        t += 15.0
        replicas = h.sync(t, replicas, 1000.0)  # asks for 20 (capped at 8)
        seen.append((t, replicas))
    first_up = next(t for t, r in seen if r > 2)
    assert first_up == 60.0  # the window holds the low recommendation from t=0 until it leaves (t > 0 + 60)
    assert dict(seen)[first_up] == 4  # +2 pods
    assert dict(seen)[first_up + 105.0] == 4  # still inside the 120 s period
    assert dict(seen)[first_up + 120.0] == 6
    assert dict(seen)[first_up + 240.0] == 8  # max replicas
    assert max(r for _, r in seen) == 8


def test_scale_down_waits_for_the_window_then_drops_to_the_highest_recent_recommendation():
    h = HPA(2, 8, target=50.0, up=SEED_UP, down=SEED_DOWN)
    t, replicas = 0.0, 8
    replicas = h.sync(t, replicas, 400.0)  # wants 8
    out = []
    while t < 700:
        t += 15.0
        replicas = h.sync(t, replicas, 100.0 if t < 200 else 0.0)  # wants 2 ... then 0 -> min 2
        out.append((t, replicas))
    assert all(r == 8 for tt, r in out if tt < 300.0)  # the 8 from t=0 stays in the window for 300 s
    assert dict(out)[300.0] == 2  # 100% per 15 s default policy, floored at min
    assert min(r for _, r in out) == 2


def test_percent_policy_and_min_select():
    up = Rules(0.0, (Policy("Percent", 50, 60.0), Policy("Pods", 1, 60.0)), select="Min")
    h = HPA(1, 100, target=1.0, up=up)
    assert h.sync(0.0, 4, 100.0) == 5  # min(ceil(4 * 1.5) = 6, 4 + 1 = 5)
    assert h.sync(15.0, 5, 100.0) == 5  # both policies spent for 60 s
    up = Rules(0.0, up.policies, select="Max")
    h = HPA(1, 100, target=1.0, up=up)
    assert h.sync(0.0, 4, 100.0) == 6
