"""The transaction written behind another's final dot on a pipelining connection.

    await written_ahead(conn, item, destination, spool, placement, sender, now) -> Ahead | None

The core picks the item (`Scheduler.follow`); this makes it the transaction for this
connection's hop, or says it should not go on it: held or deleted since it was queued, a
route this connection does not fit (another host, a suspended one, MTA-STS unverified),
an unreadable file (its own Send deals with it), refused here before a command (no
SMTPUTF8, content the hop cannot carry), or CHUNKING (its content would go at once: it
takes its own round trip instead).
"""

from __future__ import annotations

from ..policy.replies import Reply
from ..smtp.client import SmtpConnection
from ..smtp.pipeline import Ahead
from ..spool.message_file import CorruptMessageFile
from ..spool.store import Spool
from .destination import Destination, WorkItem
from .placement import Placement
from .sender import Sender


async def written_ahead(
    conn: SmtpConnection,
    item: WorkItem,
    destination: Destination,
    spool: Spool,
    placement: Placement,
    sender: Sender,
    now: float,
) -> Ahead | None:
    assert conn.pipeline is not None
    message = spool.messages.get(item.message_id)
    if message is None or message.held:
        return None
    families = placement.families(destination, item.route, now)
    if not sender.fits(conn, item.route, now, families, destination.source):
        return None
    try:
        content = spool.content(item.message_id)
    except (OSError, CorruptMessageFile):
        return None
    rcpts = [message.recipients[i] for i in item.indexes]
    made = await conn.pipeline.exchange(message, rcpts, content)
    if isinstance(made, Reply) or made[0].chunking:
        return None
    exchange, unsent = made
    return Ahead(item.message_id, exchange, unsent, [])
