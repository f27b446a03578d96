"""How often the event loop ran while something was awaited: a long walk over the queue
must yield to it (at a million queued a walk takes seconds)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def ticks_during(work: Awaitable[T]) -> tuple[T, int]:
    """`work`'s result, and how many times another task ran meanwhile."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        return await work, ticks
    finally:
        task.cancel()
