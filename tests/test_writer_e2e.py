"""The daemon and its spool writer: a killed writer loses no answer, a wedged one starves
the systemd watchdog and cannot hold up SIGTERM."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import smtplib
import socket
import threading
import time
import uuid

from daemon_process import DaemonProcess
from e2e_helpers import events, wait_for
from test_crash_e2e import alive, body, markers_in_queue, writer_pid

CLIENTS = 6


def submit(port: int, results: list[tuple[str, str, int, str]], stop: threading.Event) -> None:
    """Submit until told to stop; note each message's fate: (marker, step, code, reply)."""
    while not stop.is_set():
        marker = uuid.uuid4().hex
        try:
            with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
                client.ehlo()
                code, reply = client.mail("app@example.com")
                if code != 250:
                    results.append((marker, "mail", code, reply.decode()))
                    time.sleep(0.05)
                    continue
                client.rcpt("a@example.org")
                code, reply = client.data(body(marker))
                results.append((marker, "data", code, reply.decode()))
        except (OSError, smtplib.SMTPException) as exc:
            results.append((marker, "lost", 0, repr(exc)))


def mail_while_down(port: int, daemon: DaemonProcess, killed: int) -> str | None:
    """The first refusal of MAIL by a new client before a writer replaces `killed`."""
    while writer_pid(daemon) in (0, killed):
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
            client.ehlo()
            code, reply = client.mail("probe@example.com")
        if code != 250:
            return f"{code} {reply.decode()}"
        time.sleep(0.02)
    return None


def test_killing_the_writer_loses_no_answer_and_the_daemon_keeps_serving(start_daemon):
    daemon = start_daemon()
    results: list[tuple[str, str, int, str]] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=submit, args=(daemon.port, results, stop)) for _ in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    rng = random.Random(5)
    probes: list[str | None] = []
    try:
        for _ in range(3):
            time.sleep(rng.uniform(0.3, 0.9))
            pid = wait_for(lambda: writer_pid(daemon), what="a writer")
            os.kill(pid, signal.SIGKILL)
            # A client arriving while the writer is down is told so at MAIL. (The load's
            # own clients may all be waiting for their answer to DATA meanwhile.)
            probes.append(mail_while_down(daemon.port, daemon, pid))
            wait_for(lambda: writer_pid(daemon) not in (0, pid), what="a new writer")  # noqa: B023
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)

    assert [r for r in results if r[1] == "lost"] == [], "a client got no answer"
    acked = {
        marker: reply.rsplit(" ", 1)[1] for marker, step, code, reply in results if code == 250
    }
    refused = [r for r in results if r[2] != 250]
    assert len(acked) > 30, "the test did not put the daemon under load"
    # Refusals only say what happened: the writer is restarting (never "storage full").
    assert {code for _, _, code, _ in refused} <= {451}
    mail_refusals = [reply for _, step, _, reply in refused if step == "mail"]
    mail_refusals += [reply for reply in probes if reply is not None]
    # The restarts back off (0.5 s, then 1 s, 2 s): the later probes see a writer down.
    assert mail_refusals and all("4.3.0" in r and "restarting" in r for r in mail_refusals), [
        r for r in mail_refusals if "restarting" not in r
    ]
    # Every 250 is in the queue, once; nothing answered 451 is.
    found = markers_in_queue(daemon)
    assert {marker: ids[0] for marker, ids in found.items()} == acked
    assert all(len(ids) == 1 for ids in found.values())
    # (A new writer's pid shows before it is ready and logs its restart: on a loaded
    # machine its start-up takes a while.)
    wait_for(lambda: len(events(daemon, "spool_writer_restarted")) == 3, what="3 restarts")
    # Each writer died young, so each restart waited twice as long as the last.
    assert [e["restart_in"] for e in events(daemon, "spool_writer_lost")] == [0.5, 1.0, 2.0]
    assert daemon.send("app@example.com", ["a@example.org"], body("after"))  # still serving
    assert daemon.stop() == 0


def notify_socket(tmp_path) -> tuple[str, socket.socket]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    return path, sock


def pings(sock: socket.socket, seconds: float) -> int:
    """WATCHDOG=1 datagrams received within the next `seconds`."""
    count = 0
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            count += sock.recv(4096) == b"WATCHDOG=1"
        except TimeoutError:
            break
    return count


def test_a_wedged_writer_starves_the_watchdog(tmp_path):
    path, sock = notify_socket(tmp_path)
    daemon = DaemonProcess(tmp_path / "d")
    daemon.env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}  # pings every 0.5 s
    daemon.start()
    replies: list[int] = []
    try:
        assert pings(sock, 1.5) >= 2
        pid = writer_pid(daemon)
        os.kill(pid, signal.SIGSTOP)  # a writer stuck in a syscall, say
        waiting = threading.Thread(
            target=lambda: replies.append(daemon.send("app@example.com", ["a@x.org"], body("w")))
        )
        waiting.start()
        time.sleep(1.5)  # the stall passes WatchdogSec
        pings(sock, 0.1)  # drain
        assert pings(sock, 1.5) == 0, "the watchdog is still fed while nothing commits"
        assert daemon.wait_event("spool_stalled")["seconds"] >= 1
        os.kill(pid, signal.SIGCONT)
        waiting.join(30)
        assert len(replies) == 1  # answered once the writer moved again
        assert pings(sock, 1.5) >= 1
        assert daemon.stop() == 0
    finally:
        daemon.kill()
        sock.close()


def one_message(port: int) -> None:
    with (
        contextlib.suppress(OSError, smtplib.SMTPException),
        smtplib.SMTP("127.0.0.1", port, timeout=30) as client,
    ):
        client.ehlo()
        client.mail("app@example.com")
        client.rcpt("a@example.org")
        client.data(body("wedged"))


def test_sigterm_ends_the_daemon_within_the_grace_whatever_the_writer_does(start_daemon):
    daemon = start_daemon("spool.shutdown_grace=2s")
    pid = writer_pid(daemon)
    os.kill(pid, signal.SIGSTOP)
    waiting = threading.Thread(target=one_message, args=(daemon.port,), daemon=True)
    waiting.start()  # it waits for the wedged writer
    time.sleep(0.5)
    began = time.monotonic()
    code = daemon.stop(timeout=30)
    assert time.monotonic() - began < 2 + 3  # the grace, plus a second to commit, plus slack
    assert code == 1  # it had to give up a change: not a clean stop
    assert daemon.wait_event("spool_close_incomplete")["given_up"] >= 1
    wait_for(lambda: not alive(pid), timeout=5, what="the wedged writer to be killed")
