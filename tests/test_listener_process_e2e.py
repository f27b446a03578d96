"""The SMTP listener runs in a process of its own (listener_process.py, listener_main.py):
it is started again when it dies, ends with its daemon, and everything it handed over stays."""

from __future__ import annotations

import os
import signal
import smtplib
import socket

from e2e_helpers import ctl_json, wait_for
from postfix_tools import unused_port
from test_crash_e2e import alive

BODY = b"Subject: hi\r\n\r\nhello\r\n"


def children(pid: int, module: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == pid and module in cmdline:
            found.append(int(entry))
    return found


def send(port: int, rcpt: str) -> str:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.ehlo("app.test")
        smtp.mail("app@sender.test")
        smtp.rcpt(rcpt)
        code, reply = smtp.data(BODY)
    assert code == 250, reply
    return reply.decode().rsplit(" ", 1)[1]


def test_a_listener_killed_is_started_again_and_what_it_handed_over_stays(start_daemon):
    daemon = start_daemon()
    [listener] = children(daemon.proc.pid, b"mtaqueue.listener_main")
    before = [send(daemon.port, f"a{i}@example.org") for i in range(3)]
    os.kill(listener, signal.SIGKILL)
    restarted = daemon.wait_event("listener_restarted", timeout=20)
    assert any(e["event"] == "listener_exited" for e in daemon.events)
    [again] = children(daemon.proc.pid, b"mtaqueue.listener_main")
    assert again != listener
    port = int(restarted["listen"][0].rsplit(":", 1)[1])  # port 0 in tests: a new one
    after = send(port, "b@example.org")
    queued = {m["id"] for m in ctl_json(daemon, "list")}
    assert queued == {*before, after} and len(queued) == 4
    status = ctl_json(daemon, "status")[0]
    assert status["listen"] == restarted["listen"]


def test_the_listener_ends_with_its_daemon(start_daemon):
    daemon = start_daemon()
    [listener] = children(daemon.proc.pid, b"mtaqueue.listener_main")
    daemon.proc.kill()
    daemon.proc.wait()
    wait_for(lambda: not alive(listener), what="the listener to exit")


def test_ids_of_the_listener_and_of_the_daemon_never_meet(start_daemon):
    daemon = start_daemon()
    smtp_ids = [send(daemon.port, f"c{i}@example.org") for i in range(20)]
    # The listener's lane: odd sequence numbers (ids.py); the daemon's API and DSNs: even.
    assert all(int(queue_id, 16) % 2 == 1 for queue_id in smtp_ids)
    assert len(set(smtp_ids)) == 20 and smtp_ids == sorted(smtp_ids)


def bound(sock: socket.socket, port: int) -> bool:
    """Bind `sock` to the port, or False while another socket still listens there."""
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def test_a_listener_that_cannot_listen_again_is_tried_again(start_daemon):
    port = unused_port()
    daemon = start_daemon(f"listen.address=127.0.0.1:{port}")
    [listener] = children(daemon.proc.pid, b"mtaqueue.listener_main")
    os.kill(listener, signal.SIGKILL)
    wait_for(lambda: not alive(listener), what="the listener gone")
    with socket.socket() as squatter:  # takes the port before the new listener (1 s later)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        wait_for(lambda: bound(squatter, port), timeout=0.8, what="the old listener's port free")
        squatter.listen()
        failed = daemon.wait_event("listener_restart_failed", timeout=20)
        assert failed["retry_in"] == 5.0 and "in use" in failed["error"]
    daemon.wait_event("listener_restarted", timeout=20)
    assert send(port, "d@example.org")
