"""kill -9 under load, and full or failing disks: nothing acknowledged is ever lost."""

from __future__ import annotations

import os
import random
import smtplib
import subprocess
import threading
import time
import uuid

import pytest
from daemon_process import DaemonProcess

from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.message_file import read_message_file

CLIENTS = 8
ROUNDS = 6


def body(marker: str, size: int = 1500) -> bytes:
    return (
        f"Subject: crash test\r\nX-Marker: {marker}\r\n\r\n".encode()
        + (b"0123456789abcdef" * 4 + b"\r\n") * (size // 66)
        + f"end {marker}\r\n".encode()
    )


def submit_until_failure(port: int, acked: list[tuple[str, str]], stop: threading.Event) -> None:
    while not stop.is_set():
        marker = uuid.uuid4().hex
        try:
            with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
                client.ehlo()
                client.mail("app@example.com")
                client.rcpt("a@example.org")
                code, reply = client.data(body(marker))
        except (OSError, smtplib.SMTPException):
            return
        if code == 250:
            acked.append((marker, reply.decode().rsplit(" ", 1)[1]))


def markers_in_queue(daemon: DaemonProcess) -> dict[str, list[str]]:
    layout = SpoolLayout(daemon.spool)
    found: dict[str, list[str]] = {}
    for queue_id in daemon.messages():
        _, content = read_message_file(layout.message_path(queue_id))
        marker = content.split(b"X-Marker: ", 1)[1].split(b"\r\n", 1)[0].decode()
        found.setdefault(marker, []).append(queue_id)
        assert content.endswith(body(marker)), f"{queue_id} content differs from what was sent"
    return found


def test_kill_9_during_concurrent_submissions_loses_nothing(start_daemon):
    daemon = start_daemon()
    acked: list[tuple[str, str]] = []
    rng = random.Random(1)
    for _ in range(ROUNDS):
        stop = threading.Event()
        threads = [
            threading.Thread(target=submit_until_failure, args=(daemon.port, acked, stop))
            for _ in range(CLIENTS)
        ]
        for thread in threads:
            thread.start()
        time.sleep(rng.uniform(0.4, 1.2))
        daemon.proc.kill()  # SIGKILL, mid-flight
        daemon.proc.wait()
        stop.set()
        for thread in threads:
            thread.join(30)
        daemon.start()

    assert len(acked) > 100, "the test did not put the daemon under load"
    found = markers_in_queue(daemon)
    for marker, queue_id in acked:
        assert found.get(marker) == [queue_id], f"acked message {queue_id} lost or duplicated"
    assert all(len(ids) == 1 for ids in found.values())
    # Every file in the spool belongs to a queued message (the sweep removed orphans).
    daemon.wait_event("spool_swept")
    files = {p.name for p in SpoolLayout(daemon.spool).messages.rglob("*") if p.is_file()}
    assert files == set(daemon.messages())


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs (root only): a disk that really fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def send(daemon: DaemonProcess, content: bytes) -> tuple[int, str]:
    with smtplib.SMTP("127.0.0.1", daemon.port, timeout=30) as client:
        client.ehlo()
        code, reply = client.mail("app@example.com")
        if code != 250:
            return code, reply.decode()
        client.rcpt("a@example.org")
        code, reply = client.data(content)
        return code, reply.decode()


def test_full_disk_answers_452_and_keeps_serving(start_daemon, small_fs):
    daemon = start_daemon("spool.min_free=0", workdir=small_fs)
    acked, refused = [], []
    for i in range(60):
        code, reply = send(daemon, body(f"m{i}", size=200_000))
        (acked if code == 250 else refused).append((code, reply))
    assert acked and refused, "the file system never filled up"
    assert {code for code, _ in refused} == {452}
    assert all("4.3.1" in reply for _, reply in refused)
    with smtplib.SMTP("127.0.0.1", daemon.port, timeout=10) as client:
        assert client.noop()[0] == 250  # still serving
    # A small message still fits: the failed writes left nothing behind.
    assert send(daemon, body("small", size=100))[0] == 250
    daemon.restart()
    assert len(daemon.messages()) == len(acked) + 1
    leftovers = [p for p in SpoolLayout(daemon.spool).messages.rglob("*.tmp")]
    assert leftovers == []


def test_free_space_threshold_refuses_before_the_disk_is_full(start_daemon, small_fs):
    daemon = start_daemon("spool.min_free=40%", workdir=small_fs)
    assert send(daemon, body("a"))[0] == 250
    (small_fs / "ballast").write_bytes(b"x" * 3 * 1024 * 1024)  # someone else fills the disk
    time.sleep(2.5)  # the daemon notices within its refresh period
    code, reply = send(daemon, body("b"))
    assert code == 452 and "4.3.1" in reply
    (small_fs / "ballast").unlink()
    time.sleep(2.5)
    assert send(daemon, body("c"))[0] == 250
    assert len(daemon.messages()) == 2
    assert daemon.wait_event("spool_space_low") and daemon.wait_event("spool_space_ok")


def test_write_error_answers_451_and_recovers(daemon):
    assert send(daemon, body("before"))[0] == 250
    layout = SpoolLayout(daemon.spool)
    parked = daemon.spool / "msg.parked"
    layout.messages.rename(parked)
    layout.messages.write_bytes(b"")  # every message path now fails with ENOTDIR
    try:
        code, reply = send(daemon, body("during"))
    finally:
        layout.messages.unlink()
        parked.rename(layout.messages)
    assert code == 451 and "4.3.0" in reply
    assert send(daemon, body("after"))[0] == 250
    assert len(daemon.messages()) == 2


def test_recovery_rules_for_damaged_spools(start_daemon):
    daemon = start_daemon()
    kept = daemon.send("app@example.com", ["a@example.org"], body("kept"))
    damaged = daemon.send("app@example.com", ["a@example.org"], body("damaged"))
    assert daemon.stop() == 0
    layout = SpoolLayout(daemon.spool)
    # A bit flipped in a message file's content.
    path = layout.message_path(damaged)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    # A file that was written but never journaled (crash before the journal append),
    # and an interrupted temp file.
    orphan = "0" * 6 + kept[6:9] + "0" * 7
    layout.message_path(orphan).write_bytes(b"MTQ1 never acknowledged")
    layout.tmp_path(orphan).write_bytes(b"half")
    # A torn record at the end of the journal.
    (segment,) = sorted(layout.journal.glob("*.log"))[-1:]
    with segment.open("ab") as journal_file:
        journal_file.write(b"\x40\x00\x00\x00torn")

    daemon.start()
    recovered = daemon.wait_event("spool_recovered")
    assert recovered["dropped_bytes"] == 8
    swept = daemon.wait_event("spool_swept")
    assert swept["orphans_removed"] == 1 and swept["temp_removed"] == 1
    assert swept["quarantined"] == 1
    event = daemon.wait_event("message_quarantined")
    assert event["id"] == damaged and "checksum" in event["problem"]
    assert (layout.quarantine / damaged).exists()
    time.sleep(0.5)
    assert list(daemon.messages()) == [kept]
    assert not layout.message_path(orphan).exists() and not layout.tmp_path(orphan).exists()
    # The daemon goes on journaling after the cut tail.
    fresh = daemon.send("app@example.com", ["a@example.org"], body("fresh"))
    daemon.restart()
    assert set(daemon.messages()) == {kept, fresh}
