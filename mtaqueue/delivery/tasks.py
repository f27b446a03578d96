"""The delivery side's background tasks, kept so that a stop can end them.

Tasks()
.spawn(coro) -> Future     run it; kept until done
.cancel_all()              cancel every one and wait for them
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


class Tasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Future] = set()

    def spawn(self, coro: Awaitable) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
