"""A real Postfix relaying to mtaqueue rides through the listener's death (issue 21): its
sessions to the killed listener fail mid-stream, Postfix's queue defers and retries them,
the restarted listener takes them, and every message is in mtaqueue's queue at the end
(at least once: one whose 250 the kill swallowed may come twice, as SMTP allows).

Needs root and Debian's postfix package (`postfix_installed`).
"""

from __future__ import annotations

import os
import shutil
import signal
import smtplib
import tempfile
from collections import Counter
from pathlib import Path

from e2e_helpers import wait_for
from postfix_instance import PostfixInstance
from postfix_tools import unused_port
from test_listener_process_e2e import children

MESSAGES = 300
FILLER = "x" * 76 + "\r\n"
# Postfix retries a deferred message after a second, not its five minutes; two sessions
# and 30 KB messages keep it relaying for a while, so the kill meets it mid-stream.
RELAY = {
    "minimal_backoff_time": "1s",
    "maximal_backoff_time": "2s",
    "queue_run_delay": "1s",
    "default_destination_concurrency_limit": "2",
}


def submit(listen: str, count: int) -> None:
    host, port = listen.rsplit(":", 1)
    with smtplib.SMTP(host, int(port), timeout=30) as smtp:
        smtp.ehlo("app.test")
        for i in range(count):
            body = f"Subject: m{i}\r\nMessage-ID: <m{i}@app.test>\r\n\r\n" + FILLER * 400
            smtp.sendmail("app@sender.test", [f"u{i}@example.org"], body)


def test_a_postfix_sender_rides_through_a_listener_restart(postfix_installed, start_daemon):
    port = unused_port()  # fixed: the restarted listener takes the same port again
    daemon = start_daemon(f"listen.address=127.0.0.1:{port}")
    [listener] = children(daemon.proc.pid, b"mtaqueue.listener_main")
    workdir = Path(tempfile.mkdtemp(prefix="pfx-relay-", dir="/tmp"))  # the postfix user enters
    workdir.chmod(0o755)
    listen = f"127.0.0.1:{unused_port()}"
    try:
        with PostfixInstance(
            workdir / "pf",
            listen=listen,
            mode="relay",
            relay=f"127.0.0.1:{port}",
            main_cf=RELAY,
        ) as postfix:
            submit(listen, MESSAGES)
            # Killed while Postfix relays: some of its sessions are cut mid-stream.
            wait_for(lambda: _accepted(daemon) >= 20, what="Postfix relaying", timeout=30)
            os.kill(listener, signal.SIGKILL)
            daemon.wait_event("listener_restarted", timeout=20)
            postfix.wait_drained(60)
            log = postfix.maillog.read_text()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert "status=deferred" in log, "the kill should have cut a Postfix session"
    assert _accepted(daemon) >= MESSAGES
    queued = Counter(r["address"] for m in daemon.messages().values() for r in m["recipients"])
    assert set(queued) == {f"u{i}@example.org" for i in range(MESSAGES)}
    # At most one a Postfix session in flight at the kill (two).
    assert sum(queued.values()) - MESSAGES <= 2, queued.most_common(3)


def _accepted(daemon) -> int:
    return sum(1 for e in list(daemon.events) if e.get("event") == "accepted")
