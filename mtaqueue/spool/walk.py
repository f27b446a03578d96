"""Walking the whole queue without holding the event loop.

At a million queued messages one pass takes seconds: a status, a list, a qshape or a
metrics scrape must not stall every SMTP session meanwhile. The queue holds its
messages encoded (spool/records.py), so a walk decodes them one at a time and yields
to the loop between chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from ..model import Message

# Messages decoded per step of a walk: between steps the event loop runs.
WALK_CHUNK = 2000


async def walk(queue: Mapping[str, Message]) -> AsyncIterator[Message]:
    """The messages queued now, decoded one at a time; one that leaves the queue
    meanwhile is passed over, one that arrives meanwhile is not seen."""
    ids = list(queue)
    for start in range(0, len(ids), WALK_CHUNK):
        for queue_id in ids[start : start + WALK_CHUNK]:
            msg = queue.get(queue_id)
            if msg is not None:
                yield msg
        await asyncio.sleep(0)
