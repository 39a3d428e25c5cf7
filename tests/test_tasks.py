"""The asyncio helpers in usefulwork/tasks.py."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import uvloop

from usefulwork.tasks import raise_exit


class _SignalOnData(asyncio.Protocol):
    """A server connection that receives SIGTERM while its transport hands it data."""

    def data_received(self, data: bytes) -> None:
        signal.raise_signal(signal.SIGTERM)  # the handler runs here, inside the loop's read callback


async def _serve_and_send() -> str:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_SignalOnData, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x")
    await writer.drain()
    await asyncio.sleep(3)  # a loadtest cell: it goes on unless the signal stops the loop
    return "ran on"


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_sigterm_inside_a_transport_callback_stops_the_loop(run):
    """uvloop catches every exception a transport's callback raises ('Fatal error on transport') and runs
    on: a handler that raised SystemExit there lost the SIGTERM. raise_exit stops the loop either way."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: raise_exit(128 + signum))
    try:
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as stopped:
            run(_serve_and_send())
        assert stopped.value.code == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_a_loop_the_exit_is_raised_at_once():
    with pytest.raises(SystemExit) as stopped:
        raise_exit(3)
    assert stopped.value.code == 3
