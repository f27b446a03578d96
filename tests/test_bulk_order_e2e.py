"""A bulk command walks the queue in class order: after an outage, `flush --all` (and
`release --all`) make the first class due in their first chunk, wherever it was queued
(daemon, test DNS, a scriptable peer; the spool written by the spool's own writer)."""

from __future__ import annotations

import time

import pytest
from e2e_helpers import FAST, MailNet, ctl_json, wait_for
from queue_fill import waiting_queue

BULK, FIRST = 60000, 20  # thirty walk chunks of bulk queued before the first class


@pytest.mark.parametrize(("command", "verb"), [("flush", "flushed"), ("release", "released")])
def test_the_first_class_is_let_go_first_wherever_it_was_queued(
    command, verb, tmp_path, start_daemon
):
    with MailNet(["127.0.0.2"]) as net:
        net.add_domain("example.org", "127.0.0.2", host="mx.provider.test")
        waiting_queue(tmp_path / "spool", BULK, FIRST, held=command == "release")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        peer = net.peers[0]
        time.sleep(1)
        assert not peer.messages  # nothing due before the command
        assert ctl_json(daemon, command, "--all") == [{verb: BULK + FIRST}]
        wait_for(lambda: len(peer.messages) >= FIRST, timeout=30, what="the first deliveries")
        first = [m.rcpt_tos[0] for m in list(peer.messages)[:FIRST]]
        assert all(rcpt.startswith("reset") for rcpt in first), first
