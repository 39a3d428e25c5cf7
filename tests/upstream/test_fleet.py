from usefulwork.upstream.fleet import Fleet, parse_metrics
from usefulwork.upstream.pickers import LeastLoaded
from usefulwork.config import from_mapping

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{le="0.001"} 0.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 0.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 12.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 250.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 3.5
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 50.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 210.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 48.0
"""


def test_parse_metrics_reads_vllm_v1_names():
    m = parse_metrics(METRICS)
    assert m == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25, "prefix_queries": 100.0, "prefix_hits": 40.0,
                 "itl_sum": 12.5, "itl_count": 250.0, "prefill_sum": 3.5, "prefill_count": 50.0,
                 "e2e_sum": 210.0, "e2e_count": 48.0}


def test_live_inter_token_latency_is_the_mean_over_the_last_scrape_intervals():
    r = _fleet().pools["p"].replicas[0]
    r.take_metrics({"itl_sum": 12.5, "itl_count": 250.0, "running": 3.0})
    assert r.itl_live is None and r.scrapes == 1  # a first read has no interval
    r.take_metrics({"itl_sum": 12.5 + 40 * 0.19, "itl_count": 290.0, "running": 22.0})
    assert abs(r.itl_live - 0.19) < 1e-9 and r.running == 22.0  # 40 tokens at 190 ms: the decode speed now
    r.take_metrics({"itl_sum": 12.5 + 40 * 0.19 + 4 * 0.7, "itl_count": 294.0})
    # four tokens behind a prefill (0.7 s gaps) weigh as four tokens, not as a whole interval
    assert abs(r.itl_live - (40 * 0.19 + 4 * 0.7) / 44) < 1e-9
    for _ in range(3):
        r.take_metrics({"itl_sum": 12.5 + 40 * 0.19 + 4 * 0.7, "itl_count": 294.0})
    assert r.itl_live is None  # three intervals with nothing decoded: no figure (not the old one)
    r.take_metrics({"itl_sum": 0.4, "itl_count": 10.0})
    assert r.itl_live is None and r.scrapes == 7  # the server restarted (counters went back)
    r.take_metrics({"itl_sum": 0.4 + 10 * 0.05, "itl_count": 20.0})
    assert r.itl_live is None  # 10 tokens: too few for a figure
    r.take_metrics({"itl_sum": 0.4 + 40 * 0.05, "itl_count": 50.0})
    assert abs(r.itl_live - 0.05) < 1e-9


def test_live_prefill_time_is_the_mean_over_the_last_scrape_intervals():
    r = _fleet().pools["p"].replicas[0]
    r.take_metrics({"prefill_sum": 3.5, "prefill_count": 50.0})
    assert r.prefill_live is None  # a first read has no interval
    r.take_metrics({"prefill_sum": 3.5 + 0.08, "prefill_count": 51.0})
    assert r.prefill_live is None  # one prefill: too few for a figure
    r.take_metrics({"prefill_sum": 3.5 + 0.08 + 3 * 0.12, "prefill_count": 54.0})
    assert abs(r.prefill_live - (0.08 + 3 * 0.12) / 4) < 1e-9  # per prefill, over the intervals
    r.take_metrics({"prefill_sum": 0.1, "prefill_count": 1.0})
    assert r.prefill_live is None  # the server restarted


def test_live_request_time_is_the_mean_over_the_last_scrape_intervals():
    r = _fleet().pools["p"].replicas[0]
    r.take_metrics({"e2e_sum": 210.0, "e2e_count": 48.0})
    assert r.e2e_live is None  # a first read has no interval
    r.take_metrics({"e2e_sum": 210.0 + 9.5, "e2e_count": 49.0})
    assert r.e2e_live is None  # one request ended: too few for a figure
    r.take_metrics({"e2e_sum": 210.0 + 9.5 + 2 * 10.25, "e2e_count": 51.0})
    assert abs(r.e2e_live - 10.0) < 1e-9  # per ended request, over the intervals, whoever sent it
    for _ in range(3):
        r.take_metrics({"e2e_sum": 240.0, "e2e_count": 51.0})
    assert r.e2e_live is None  # nothing ended in the window: no figure (not the old one)
    r.take_metrics({"e2e_sum": 3.0, "e2e_count": 1.0})
    assert r.e2e_live is None  # the server restarted


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
    assert LeastLoaded().pick(None, f.candidates(f.pools["p"])) == [b, a]
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


async def test_probe_marks_down_then_back_up_and_scrapes_load():
    """A real HTTP server whose /health flips 200 -> 503 -> 200; /metrics carries vLLM gauges."""
    import asyncio

    state = {"status": b"200 OK"}

    async def handler(r, w):
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /metrics"):
                    body = METRICS.encode()
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                else:
                    w.write(b"HTTP/1.1 " + state["status"] + b"\r\ncontent-length: 0\r\n\r\n")
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    cfg = from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": [url]}],
                        "timeouts": {"retry_after_down_s": 0.01}}, environ={})
    fleet = Fleet(cfg)
    (rep,) = fleet.replicas
    await fleet.check_once()
    assert rep.healthy and rep.running == 3.0 and rep.prefix_hit_rate == 0.4 and fleet.ready()
    state["status"] = b"503 Service Unavailable"
    await fleet.check_once()
    assert not rep.healthy and "503" in rep.down_reason and not fleet.ready()
    state["status"] = b"200 OK"
    await asyncio.sleep(0.02)  # past retry_after_down_s
    await fleet.check_once()
    assert rep.healthy and rep.down_reason is None
    await fleet.stop()
    server.close()


def test_lease_counts_once_and_releases_on_exception():
    f = _fleet()
    a = f.pools["p"].replicas[0]
    lease = f.lease(a)
    assert a.inflight == 1
    lease.release()
    lease.release()  # idempotent: a second release never takes another request's count
    assert a.inflight == 0
    try:
        with f.lease(a):
            assert a.inflight == 1
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert a.inflight == 0
