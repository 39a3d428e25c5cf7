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
    stops with it, and ``asyncio.run`` cancels its tasks); the callback runs even if the loop was about to
    stop, since ``asyncio.run`` runs the loop once more to close it. Without a loop: at once."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise SystemExit(code) from None
    loop.call_soon_threadsafe(_exit, code)


def _exit(code: int) -> None:
    raise SystemExit(code)
