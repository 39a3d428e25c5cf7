"""The data-path HTTP/1.1 pool against real TCP servers (asyncio servers written for each case)."""

from __future__ import annotations

import asyncio

import pytest

from usefulwork.upstream.http1 import ConnectFailed, UpstreamClosed, UpstreamPool, UpstreamTimeout, UpstreamTooLarge

BODY = b'{"ok":true}'
UNARY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)


async def _server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    return head + await reader.readexactly(n)


async def test_keep_alive_reuses_one_connection():
    connections = []

    async def handler(r, w):
        connections.append(1)
        try:
            while True:
                req = await _read_request(r)
                assert req.startswith(b"POST /v1/x HTTP/1.1") and b"x-test: 1" in req
                w.write(UNARY)
                await w.drain()
        except asyncio.IncompleteReadError:
            w.close()

    server, url = await _server(handler)
    pool = UpstreamPool(url)
    for _ in range(5):
        resp = await pool.request(b"POST", b"/v1/x", b"{}", b"x-test: 1\r\n")
        assert resp.status == 200 and resp.header(b"content-type") == b"application/json"
        assert await resp.read() == BODY
        resp.close()
    assert len(connections) == 1
    pool.close()
    server.close()


async def test_chunked_stream_arrives_in_pieces_and_decoded():
    async def handler(r, w):
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            data = b"data: %d\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(data), data))
            await w.drain()
            await asyncio.sleep(0.02)
        w.write(b"0\r\n\r\n")
        await w.drain()

    server, url = await _server(handler)
    pool = UpstreamPool(url)
    resp = await pool.request(b"POST", b"/s", b"{}")
    pieces = []
    while (c := await resp.read_chunk()) is not None:
        pieces.append(c)
    assert b"".join(pieces) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(pieces) >= 2, "chunks must be delivered as they arrive, not buffered to the end"
    resp.close()
    server.close()


async def test_connect_refused_is_connect_failed():
    server, url = await _server(lambda r, w: None)
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectFailed):
        await UpstreamPool(url, connect_timeout=2).request(b"POST", b"/", b"")


async def test_header_timeout():
    async def handler(r, w):
        await _read_request(r)
        await asyncio.sleep(5)

    server, url = await _server(handler)
    with pytest.raises(UpstreamTimeout):
        await asyncio.wait_for(UpstreamPool(url, header_timeout=0.2).request(b"POST", b"/", b""), 3)
    server.close()


async def test_read_timeout_between_body_chunks():
    async def handler(r, w):
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await asyncio.sleep(5)

    server, url = await _server(handler)
    resp = await UpstreamPool(url, read_timeout=0.2, header_timeout=3).request(b"POST", b"/", b"")
    assert await resp.read_chunk() == b"hello"
    with pytest.raises(UpstreamTimeout):
        await asyncio.wait_for(resp.read_chunk(), 3)
    resp.close()
    server.close()


async def test_timeouts_count_from_each_wait_on_a_kept_alive_connection():
    """One timer per connection, its deadline moved by every wait: gaps under the read timeout never fail
    however long the whole body takes, and the next request's header timeout still fires on time."""
    connections = []

    async def handler(r, w):
        connections.append(1)
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(4):
            await asyncio.sleep(0.15)
            w.write(b"1\r\nx\r\n")
            await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()
        await _read_request(r)  # the second request, on the same connection: never answered
        await asyncio.sleep(5)

    server, url = await _server(handler)
    pool = UpstreamPool(url, read_timeout=0.3, header_timeout=0.5)
    resp = await pool.request(b"POST", b"/", b"")
    assert await resp.read() == b"xxxx"  # 0.6 s in all, 0.15 s per gap
    resp.close()
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamTimeout):
        await asyncio.wait_for(pool.request(b"POST", b"/", b""), 3)
    assert 0.45 <= asyncio.get_running_loop().time() - t0 < 1.5
    assert len(connections) == 1
    pool.close()
    server.close()


async def test_server_dies_mid_body_raises_closed():
    async def handler(r, w):
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await w.drain()
        w.transport.abort()

    server, url = await _server(handler)
    resp = await UpstreamPool(url).request(b"POST", b"/", b"")
    with pytest.raises(UpstreamClosed):
        await resp.read()
    server.close()


async def test_stale_idle_connection_is_retried_transparently():
    served = []

    async def handler(r, w):
        await _read_request(r)
        served.append(1)
        w.write(UNARY)
        await w.drain()
        w.close()  # the server closes after every response despite HTTP/1.1 keep-alive

    server, url = await _server(handler)
    pool = UpstreamPool(url)
    for _ in range(3):
        resp = await pool.request(b"POST", b"/", b"")
        assert await resp.read() == BODY
        resp.close()
        await asyncio.sleep(0.05)
    assert len(served) == 3
    server.close()


async def test_close_before_complete_aborts_the_connection():
    closed = asyncio.Event()

    async def handler(r, w):
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        try:
            while await r.read(100):
                pass
        finally:
            closed.set()

    server, url = await _server(handler)
    pool = UpstreamPool(url)
    resp = await pool.request(b"POST", b"/", b"")
    assert await resp.read_chunk() == b"hello"
    resp.close()  # the client went away: the upstream must see the connection drop
    await asyncio.wait_for(closed.wait(), 5)
    assert not pool._idle
    server.close()


async def test_non_streaming_body_over_the_limit_fails_that_request_only():
    """Issue #9.8: a 2 GiB answer was buffered whole. Now reading stops at max_body_bytes."""
    sent = []

    async def handler(r, w):
        try:
            while True:
                req = await _read_request(r)
                if b"/big" in req.split(b"\r\n", 1)[0]:
                    w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    chunk = b"x" * 65536
                    for _ in range(1024):  # up to 64 MiB, unless the client gives up first
                        w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        await w.drain()
                        sent.append(len(chunk))
                    w.write(b"0\r\n\r\n")
                elif b"/declared" in req.split(b"\r\n", 1)[0]:
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2147483648\r\n\r\n")
                else:
                    w.write(UNARY)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    server, url = await _server(handler)
    pool = UpstreamPool(url, max_body_bytes=1 << 20)
    resp = await pool.request(b"POST", b"/big", b"{}")
    with pytest.raises(UpstreamTooLarge):
        await asyncio.wait_for(resp.read(), 10)
    resp.close()
    assert sum(sent) < 8 << 20, "the gateway kept reading far past the limit"
    resp = await pool.request(b"POST", b"/declared", b"{}")
    with pytest.raises(UpstreamTooLarge):  # a declared length over the limit fails before any read
        await asyncio.wait_for(resp.read(), 5)
    resp.close()
    resp = await pool.request(b"POST", b"/small", b"{}")  # the pool keeps serving
    assert await resp.read() == BODY
    resp.close()
    pool.close()
    server.close()


async def test_post_is_never_sent_twice_when_a_reused_connection_closes_before_the_answer():
    """Issue #9.10: the same POST reached the replica twice (once per connection)."""
    received = []

    async def handler(r, w):
        try:
            while True:
                req = await _read_request(r)
                received.append(req)
                if len(received) == 2:
                    w.transport.abort()  # read the request (maybe processed it), then died
                    return
                w.write(UNARY)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    server, url = await _server(handler)
    pool = UpstreamPool(url)
    resp = await pool.request(b"POST", b"/v1/x", b"{}")
    assert await resp.read() == BODY
    resp.close()  # back to the pool: the next request reuses this connection
    with pytest.raises(UpstreamClosed) as e:
        await pool.request(b"POST", b"/v1/x", b'{"n":2}')
    assert e.value.maybe_processed  # the caller may retry elsewhere, and must say so
    await asyncio.sleep(0.2)
    assert len(received) == 2
    pool.close()
    server.close()


async def test_connection_idle_past_the_server_keep_alive_is_not_reused():
    connections = []

    async def handler(r, w):
        connections.append(1)
        try:
            while True:
                await _read_request(r)
                w.write(UNARY)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    server, url = await _server(handler)
    pool = UpstreamPool(url, idle_s=0.2)
    for pause in (0.0, 0.05, 0.4):
        await asyncio.sleep(pause)
        resp = await pool.request(b"POST", b"/", b"")
        assert await resp.read() == BODY
        resp.close()
    assert len(connections) == 2  # reused after 50 ms, not after 400 ms idle
    pool.close()
    server.close()


async def test_interim_1xx_responses_are_skipped():
    """Issue #9.11: a 100 Continue was taken for the final status."""
    async def handler(r, w):
        await _read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(UNARY)
        await w.drain()

    server, url = await _server(handler)
    pool = UpstreamPool(url)
    resp = await pool.request(b"POST", b"/", b"{}")
    assert resp.status == 200 and resp.header(b"link") is None
    assert await resp.read() == BODY
    resp.close()
    pool.close()
    server.close()


async def test_response_delimited_by_connection_close():
    """Issue #9.11: no Content-Length, no chunking: the body ends when the server closes."""
    async def handler(r, w):
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n" + BODY[:4])
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(BODY[4:])
        await w.drain()
        w.close()

    server, url = await _server(handler)
    pool = UpstreamPool(url)
    resp = await pool.request(b"POST", b"/", b"{}")
    assert resp.status == 200
    assert await asyncio.wait_for(resp.read(), 5) == BODY
    resp.close()
    assert not pool._idle
    pool.close()
    server.close()


async def test_credentials_in_the_url_never_reach_the_host_header():
    """Issue #9.14: ``http://user:pw@host`` sent ``host: user:pw@host`` upstream."""
    heads = []

    async def handler(r, w):
        heads.append(await _read_request(r))
        w.write(UNARY)
        await w.drain()

    server, url = await _server(handler)
    pool = UpstreamPool(url.replace("http://", "http://user:s3cret@"))
    resp = await pool.request(b"POST", b"/", b"{}")
    await resp.read()
    resp.close()
    assert b"host: 127.0.0.1:" in heads[0] and b"s3cret" not in heads[0]
    pool.close()
    server.close()
