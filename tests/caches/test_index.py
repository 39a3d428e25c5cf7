import numpy as np

from usefulwork.caches.index import PartitionIndex
from usefulwork.caches.thresholds import ThresholdPolicy
from usefulwork.caches.config import SemanticCfg


def unit(rng, n):
    v = rng.standard_normal((n, 384)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_exact_and_hnsw_modes_find_the_same_nearest_and_skip_removed():
    rng = np.random.default_rng(0)
    vecs = unit(rng, 600)
    small, big = PartitionIndex(hnsw_min=10_000), PartitionIndex(hnsw_min=100)
    for i, v in enumerate(vecs):
        small.add(f"k{i}", v)
        big.add(f"k{i}", v)
    assert big._hnsw is not None and small._hnsw is None
    for i in (0, 17, 599):
        assert small.search(vecs[i], 1)[0][0] == f"k{i}" == big.search(vecs[i], 1)[0][0]
    for idx in (small, big):
        idx.remove("k17")
        assert all(k != "k17" for k, _ in idx.search(vecs[17], 4)) and len(idx) == 599
    for i in range(300):  # many removals trigger a rebuild; survivors are still found
        big.remove(f"k{i}")
    assert len(big) == 300 and big.search(vecs[450], 1)[0][0] == "k450"


def test_policy_raises_model_threshold_only_as_far_as_the_bound_needs():
    p = ThresholdPolicy(SemanticCfg(threshold=0.9, error_bound=0.1))
    for i in range(20):
        p.record_hit(f"r{i}", "t", "m", f"e{i}", 0.90 + i * 0.004)  # scores 0.900 .. 0.976
    assert p.report_bad("r0", "other-tenant") is None
    p.report_bad("r0", "t")  # 1 bad of 20 (5%) is within 10%: the model keeps 0.9
    assert p.threshold("m") == 0.9 and p.threshold("m", "e0") > 0.9
    p.report_bad("r1", "t")
    p.report_bad("r2", "t")  # 3 bad (the 3 lowest) of 20 is 15%: serving the top 18 (1 bad, 5.6%)
    assert abs(p.threshold("m") - 0.905) < 1e-9  # is within the bound: just above the 19th score
