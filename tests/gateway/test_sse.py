import orjson
import pytest

from usefulwork.gateway.sse import DONE_EVENT, SSEFilter, error_event

C1 = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
C2 = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n'
USAGE = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n'
STREAM = C1 + C2 + USAGE + DONE_EVENT


def _run(filt, pieces):
    return b"".join(filt.feed(p) for p in pieces) + filt.flush()


def test_passthrough_is_byte_identical_when_usage_requested():
    f = SSEFilter(keep_usage=True)
    assert _run(f, [STREAM]) == STREAM
    assert f.usage["completion_tokens"] == 2
    assert f.done and f.events == 3


def test_usage_chunk_stripped_but_recorded_when_not_requested():
    f = SSEFilter(keep_usage=False)
    out = _run(f, [STREAM])
    assert out == C1 + C2 + DONE_EVENT
    assert f.usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_arbitrary_split_points_reassemble():
    for step in (1, 3, 7, 50):
        pieces = [STREAM[i:i + step] for i in range(0, len(STREAM), step)]
        f = SSEFilter(keep_usage=False)
        assert _run(f, pieces) == C1 + C2 + DONE_EVENT
        assert f.usage["prompt_tokens"] == 5 and f.done


def test_content_chunk_with_usage_is_kept():
    # vLLM continuous usage stats put usage on content chunks too: never drop content.
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    f = SSEFilter(keep_usage=False)
    assert _run(f, [chunk]) == chunk
    assert f.usage["completion_tokens"] == 1


def test_incomplete_stream_not_done():
    f = SSEFilter(keep_usage=False)
    out = _run(f, [C1, C2[:10]])
    assert out == C1 + C2[:10]
    assert not f.done and f.usage is None


def test_error_event_shape():
    ev = error_event("boom", 502)
    first, done = ev.split(b"\n\n", 1)
    body = orjson.loads(first[6:])
    assert body["error"]["message"] == "boom" and body["error"]["code"] == 502
    assert done == DONE_EVENT


def test_unterminated_event_costs_linear_time_and_is_bounded():
    """Issue #9.8: an event with no blank line was re-joined and re-scanned on every read
    (quadratic: 33 s of event-loop CPU); and it grew without bound."""
    import time

    from usefulwork.upstream.http1 import UpstreamTooLarge

    filt = SSEFilter(keep_usage=False, max_event_bytes=64 << 20)
    piece = b"x" * 2048
    t0 = time.process_time()
    assert filt.feed(b"data: ") == b""
    for _ in range(8 * 512):  # 8 MiB in 2 KiB reads (the old filter: ~17 GB of copying, as much scanning)
        assert filt.feed(piece) == b""
    took = time.process_time() - t0
    assert took < 2.0, f"{took:.1f}s of CPU for one 8 MiB event"
    out = filt.feed(b"\n\ndata: [DONE]\n\n")
    assert len(out) == 6 + 8 * 512 * 2048 + 2 + len(b"data: [DONE]\n\n") and filt.done
    small = SSEFilter(keep_usage=False, max_event_bytes=4096)
    assert small.feed(b'data: {"a":1}\n\ndata: {"b"') == b'data: {"a":1}\n\n'
    with pytest.raises(UpstreamTooLarge):
        for _ in range(10):
            small.feed(piece)


def test_event_separator_split_across_reads():
    filt = SSEFilter(keep_usage=False)
    assert filt.feed(b"data: 1\n") == b""
    assert filt.feed(b"\ndata: 2") == b"data: 1\n\n"
    assert filt.feed(b"\n") == b""
    assert filt.feed(b"\n") == b"data: 2\n\n"
