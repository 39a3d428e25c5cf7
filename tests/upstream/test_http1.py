"""The data-path HTTP/1.1 pool against real TCP servers (asyncio servers written for each case)."""

from __future__ import annotations

import asyncio

import pytest

from usefulwork.upstream.http1 import ConnectFailed, UpstreamClosed, UpstreamPool, UpstreamTimeout

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
