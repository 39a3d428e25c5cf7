"""Small asyncio helpers shared by the gateway's background loops."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has unwound; its cancellation is not an error."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def raise_exit(code: int) -> None:
    """Raise ``SystemExit(code)`` from a signal handler at a point where nothing can swallow it.

    A Python signal handler runs between two bytecodes of whatever the main thread runs. Inside an event
    loop that is often a transport's callback, and uvloop catches every exception there: it logs "Fatal
    error on transport", closes that one connection and runs on. A SIGTERM that landed in one was lost (a
    killed loadtest ran its whole 300 s cell, then the next profile). With a loop running in this thread the
    exit is raised from a callback of the loop's own, which asyncio and uvloop both let through (the loop
    stops with it, and ``asyncio.run`` cancels its tasks). Without a loop: at once.

    Where the signal lands as a loop closes, the callback can be dropped with the loop, or raised inside
    ``asyncio.run``'s own shutdown, which then fails with a RuntimeError (uvicorn's re-raise of the signal
    at its end did that: the gateway's handler raises at once for that reason). The exit is also kept
    until ``take_pending_exit``, for the caller to raise once the loop is gone."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise SystemExit(code) from None
    _pending.append(code)
    loop.call_soon_threadsafe(_exit, code)


_pending: list[int] = []  # exits raise_exit scheduled on a loop, until taken


def take_pending_exit() -> int | None:
    """The first exit ``raise_exit`` scheduled on a loop since the last call (None: none); forgets them all."""
    code = _pending[0] if _pending else None
    _pending.clear()
    return code


def _exit(code: int) -> None:
    raise SystemExit(code)
