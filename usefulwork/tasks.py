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
