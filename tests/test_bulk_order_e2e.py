"""A bulk command walks the queue in class order: after an outage, `flush --all` (and
`release --all`) make the first class due in their first chunk, wherever it was queued
(daemon, test DNS, a scriptable peer; the spool written by the spool's own writer)."""

from __future__ import annotations

import time

import pytest
from e2e_helpers import FAST, MailNet, ctl_json, wait_for

from mtaqueue.ids import IdGenerator
from mtaqueue.model import DEFERRED, HELD_BY_OPERATOR, Message, Recipient
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.writer import Accept, SpoolWriter

BULK, FIRST = 60000, 20  # thirty walk chunks of bulk queued before the first class


def waiting_queue(spool, held: bool) -> None:
    """BULK p2 messages, then FIRST p0 ones, all to example.org: held, or deferred for
    an hour (an outage's mail)."""
    SpoolLayout(spool).create()
    writer = SpoolWriter(spool, compact_size=1 << 40, dedupe_window=86400)
    ids, now = IdGenerator(), time.time()
    content = b"Subject: queued\r\n\r\nbody\r\n"
    mail = [("p2", f"news{i}@example.org") for i in range(BULK)]
    mail += [("p0", f"reset{i}@example.org") for i in range(FIRST)]
    batch = []
    for klass, rcpt in mail:
        message = Message(
            id=ids.next(),
            sender="app@sender.test",
            recipients=(
                Recipient(rcpt)
                if held
                else Recipient(rcpt, state=DEFERRED, next_attempt=now + 3600),
            ),
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


@pytest.mark.parametrize(("command", "verb"), [("flush", "flushed"), ("release", "released")])
def test_the_first_class_is_let_go_first_wherever_it_was_queued(
    command, verb, tmp_path, start_daemon
):
    with MailNet(["127.0.0.2"]) as net:
        net.add_domain("example.org", "127.0.0.2", host="mx.provider.test")
        waiting_queue(tmp_path / "spool", held=command == "release")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        peer = net.peers[0]
        time.sleep(1)
        assert not peer.messages  # nothing due before the command
        assert ctl_json(daemon, command, "--all") == [{verb: BULK + FIRST}]
        wait_for(lambda: len(peer.messages) >= FIRST, timeout=30, what="the first deliveries")
        first = [m.rcpt_tos[0] for m in list(peer.messages)[:FIRST]]
        assert all(rcpt.startswith("reset") for rcpt in first), first
