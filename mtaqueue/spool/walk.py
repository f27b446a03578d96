"""Walking the whole queue without holding the event loop.

At a million queued messages one pass takes seconds: a status, a list, a qshape or a
metrics scrape must not stall every SMTP session meanwhile. The queue holds its
messages encoded (spool/records.py), so a walk decodes them one at a time and yields
to the loop between chunks. The delivery manager's walks (start, expiry) read ids a
chunk at a time too, with `chunks`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping

from ..model import Message

# Messages decoded per step of a walk: between steps the event loop runs.
WALK_CHUNK = 2000


async def walk(queue: Mapping[str, Message]) -> AsyncIterator[Message]:
    """The messages queued now, decoded one at a time; one that leaves the queue
    meanwhile is passed over, one that arrives meanwhile is not seen."""
    for chunk in chunks(list(queue)):
        for queue_id in chunk:
            msg = queue.get(queue_id)
            if msg is not None:
                yield msg
        await asyncio.sleep(0)


def chunks(ids: list[str]) -> Iterator[list[str]]:
    """`ids` a WALK_CHUNK at a time, for walks that yield to the loop between chunks."""
    for start in range(0, len(ids), WALK_CHUNK):
        yield ids[start : start + WALK_CHUNK]
