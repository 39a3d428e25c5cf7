"""A zero-think-time OpenAI-compatible backend for overhead benchmarks.

A raw asyncio Protocol (uvloop when installed) that answers as fast as Python can: canned
non-streaming chat completions, or 16 SSE content chunks (+ usage when asked) + [DONE], each chunk
its own write with a yield in between so that the proxy sees real separate chunks. It also answers
/health and /metrics so the gateway considers it a healthy replica. Not a vLLM imitation: see
usefulwork.backends.sim for that.

    python benchmarks/mock_openai.py --port 9100
"""

from __future__ import annotations

import argparse
import asyncio

CHUNKS = 16
_UNARY = (
    b'{"id":"chatcmpl-mock","object":"chat.completion","created":1,"model":"mock",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"' + b"tok " * CHUNKS + b'"},'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":12,"completion_tokens":16,"total_tokens":28}}'
)
_UNARY_RESP = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
               + str(len(_UNARY)).encode() + b"\r\n\r\n" + _UNARY)
_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_EVENT = b'data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":1,"model":"mock","choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
_USAGE_EVENT = b'data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":1,"model":"mock","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":16,"total_tokens":28}}\n\n'
_DONE = b"data: [DONE]\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_CHUNK_EVENT = _chunk(_EVENT)
_CHUNK_TAIL_USAGE = _chunk(_USAGE_EVENT) + _chunk(_DONE) + b"0\r\n\r\n"
_CHUNK_TAIL = _chunk(_DONE) + b"0\r\n\r\n"
_OK_EMPTY = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 0\r\n\r\n"
_MODELS = b'{"object":"list","data":[{"id":"mock","object":"model"}]}'
_MODELS_RESP = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(_MODELS)).encode() + b"\r\n\r\n" + _MODELS)


class MockOpenAI(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._process()

    def _process(self) -> None:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            low = head.lower()
            i = low.find(b"content-length:")
            if i >= 0:
                j = low.find(b"\r\n", i)
                length = int(low[i + 15:j if j > 0 else None])
            total = end + 4 + length
            if len(self.buf) < total:
                return
            body = self.buf[end + 4:total]
            self.buf = self.buf[total:]
            line = head[:head.find(b"\r\n")]
            if line.startswith(b"GET"):
                self.transport.write(_MODELS_RESP if b"/models" in line else _OK_EMPTY)
                continue
            if b'"stream":true' in body or b'"stream": true' in body:
                self.busy = True
                asyncio.ensure_future(self._stream(b'"include_usage":true' in body or b'"include_usage": true' in body))
                return
            self.transport.write(_UNARY_RESP)

    async def _stream(self, usage: bool) -> None:
        t = self.transport
        t.write(_SSE_HEAD)
        for _ in range(CHUNKS):
            t.write(_CHUNK_EVENT)
            await asyncio.sleep(0)  # yield: separate writes, as a token-by-token server would make
        t.write(_CHUNK_TAIL_USAGE if usage else _CHUNK_TAIL)
        self.busy = False
        if self.buf:
            self._process()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(MockOpenAI, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100)
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
