from usefulwork.backends.fleet import Fleet, parse_metrics
from usefulwork.config import from_mapping

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{le="0.001"} 0.0
"""


def test_parse_metrics_reads_vllm_v1_names():
    m = parse_metrics(METRICS)
    assert m == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25, "prefix_queries": 100.0, "prefix_hits": 40.0}


def _fleet():
    cfg = from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": ["http://a:1", "http://b:1"]}]}, environ={})
    return Fleet(cfg)


def test_candidates_prefer_healthy_least_loaded():
    f = _fleet()
    a, b = f.pools["p"].replicas
    f.mark_up(a)
    f.mark_up(b)
    a.inflight = 5
    b.running, b.waiting = 1, 1
    assert f.candidates(f.pools["p"]) == [b, a]
    f.mark_down(b, "test")
    assert f.candidates(f.pools["p"]) == [a]
    assert f.ready()


def test_all_down_still_offers_expired_backoff():
    f = _fleet()
    a, b = f.pools["p"].replicas
    f.mark_down(a, "x")
    f.mark_down(b, "x")
    a.down_until = 0.0
    assert f.candidates(f.pools["p"]) == [a]
    assert not f.ready()
