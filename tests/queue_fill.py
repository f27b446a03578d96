"""A queue written straight into a spool by the spool's own writer (no SMTP, no daemon).

    waiting_queue(spool, bulk, first, held)   `bulk` p2 messages, then `first` p0 ones

Every message has one recipient at example.org: news<i>@ for the p2 ones, reset<i>@ for
the p0 ones. `held`: held by the operator; else deferred for an hour (an outage's mail).
"""

from __future__ import annotations

import time
from pathlib import Path

from mtaqueue.ids import IdGenerator
from mtaqueue.model import DEFERRED, HELD_BY_OPERATOR, Message, Recipient
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.writer import Accept, SpoolWriter


def waiting_queue(spool: Path, bulk: int, first: int, held: bool) -> None:
    SpoolLayout(spool).create()
    writer = SpoolWriter(spool, compact_size=1 << 40, dedupe_window=86400)
    ids, now = IdGenerator(), time.time()
    content = b"Subject: queued\r\n\r\nbody\r\n"
    mail = [("p2", f"news{i}@example.org") for i in range(bulk)]
    mail += [("p0", f"reset{i}@example.org") for i in range(first)]
    batch = []
    later = now + 3600
    for klass, rcpt in mail:
        waits = Recipient(rcpt) if held else Recipient(rcpt, state=DEFERRED, next_attempt=later)
        message = Message(
            id=ids.next(),
            sender="app@sender.test",
            recipients=(waits,),
            created=now,
            size=len(content),
            klass=klass,
            held=held,
            held_reason=HELD_BY_OPERATOR if held else "",
            held_at=now if held else None,
        )
        batch.append(Accept(message, content))
        if len(batch) == 500:
            assert not any(writer.commit(batch))
            batch = []
    assert not any(writer.commit(batch))
    writer.close()
