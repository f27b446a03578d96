"""kill -9 under load, and full or failing disks: nothing acknowledged is ever lost."""

from __future__ import annotations

import os
import random
import signal
import smtplib
import struct
import subprocess
import threading
import time
import uuid
import zlib

import pytest
from daemon_process import DaemonProcess
from e2e_helpers import FAST, MailNet, events, wait_for

from mtaqueue.ids import IdGenerator
from mtaqueue.model import Message, Recipient
from mtaqueue.spool import journal
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.message_file import file_parts, read_message_file

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
    found: dict[str, list[str]] = {}
    for queue_id in daemon.messages():
        content = daemon.stored(queue_id)
        marker = content.split(b"X-Marker: ", 1)[1].split(b"\r\n", 1)[0].decode()
        found.setdefault(marker, []).append(queue_id)
        assert content.endswith(body(marker)), f"{queue_id} content differs from what was sent"
    return found


def writer_pid(daemon: DaemonProcess) -> int:
    """The daemon's live writer child (0 if none): what an operator's `kill -9` hits."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == daemon.proc.pid and b"mtaqueue.spool.writer" in cmdline:
            return int(entry)
    return 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_kill_9_during_concurrent_submissions_loses_nothing(start_daemon):
    daemon = start_daemon()
    acked: list[tuple[str, str]] = []
    not_json: list[str] = []
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
        writer = writer_pid(daemon)
        daemon.proc.kill()  # SIGKILL, mid-flight
        daemon.proc.wait()
        stop.set()
        for thread in threads:
            thread.join(30)
        wait_for(lambda: not alive(writer), what="the orphaned writer to exit")  # noqa: B023
        time.sleep(0.3)  # its last words, if any, reach the log reader
        not_json += [e["text"] for e in daemon.events if e.get("event") == "non_json"]
        daemon.start()

    assert not_json == [], "the writer complained when its daemon died"

    assert len(acked) > 100, "the test did not put the daemon under load"
    found = markers_in_queue(daemon)
    for marker, queue_id in acked:
        assert found.get(marker) == [queue_id], f"acked message {queue_id} lost or duplicated"
    assert all(len(ids) == 1 for ids in found.values())
    # Every file in the spool belongs to a queued message (the sweep removed orphans).
    daemon.wait_event("spool_swept")
    files = {p.name for p in SpoolLayout(daemon.spool).messages.rglob("*") if p.is_file()}
    assert files == set(daemon.messages())


def test_power_lost_while_files_wait_loses_nothing(start_daemon):
    """Daemon and writer gone at once (no stop, no writer's last round): the mail whose
    files waited (spool/filing.py) is in the journal alone; the next start writes those
    files and queues every message, with its content, once."""
    daemon = start_daemon("spool.file_after=60s", "delivery.enabled=false")
    sent = {daemon.send("app@example.com", ["a@example.org"], body(f"p{n}")): f"p{n}"
            for n in range(20)}  # fmt: skip
    layout = SpoolLayout(daemon.spool)
    assert not any(layout.message_path(queue_id).exists() for queue_id in sent)
    writer = writer_pid(daemon)
    os.kill(writer, signal.SIGSTOP)  # so that it cannot finish a round as its daemon dies
    daemon.kill()
    os.kill(writer, signal.SIGKILL)
    wait_for(lambda: not alive(writer), what="the writer to die")
    daemon.start()
    daemon.wait_event("spool_swept")
    assert {queue_id: marker for marker, (queue_id,) in markers_in_queue(daemon).items()} == sent
    for queue_id, marker in sent.items():  # written by the new writer as it starts
        assert read_message_file(layout.message_path(queue_id))[1].endswith(body(marker))
    assert not [e for e in daemon.events if e.get("event") == "spool_damaged"]


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


@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
def test_a_dsn_refused_for_want_of_space_keeps_the_original_until_it_is_stored(
    start_daemon, small_fs, restart
):
    """The bounce of a message finds the disk too full for its DSN (the original's record
    would still fit): the original stays queued, the DSN is stored once there is room, and
    only then does the original go. `restart`: the daemon stops while the disk is still
    full; the bounce must not be lost with it (the original is tried again after the
    restart, so its DSN is made again)."""
    with MailNet(["127.0.0.2", "127.0.0.9"]) as net:
        mx, home = net.peers
        net.add_domain("example.org", "127.0.0.2")
        net.add_domain("sender.test", "127.0.0.9")
        mx.on("rcpt", "451 4.3.0 try later")
        daemon = start_daemon(*net.daemon_overrides(), *FAST, "spool.min_free=0", workdir=small_fs)
        queue_id = daemon.send("app@sender.test", ["x@example.org"], body("b", size=90_000))
        wait_for(lambda: events(daemon, "delivery"), what="the first attempt")
        st = os.statvfs(small_fs)
        (small_fs / "ballast").write_bytes(b"x" * (st.f_bavail * st.f_frsize - 40_000))
        mx.on("rcpt", "550 5.1.1 no such user")
        wait_for(lambda: events(daemon, "dsn_failed"), what="the DSN refused")
        assert events(daemon, "delivery")[-1]["outcome"] == "permanent"
        assert queue_id in daemon.messages()  # kept: its DSN is not stored
        if restart:
            assert daemon.stop() == 0  # the DSN is still not stored
        (small_fs / "ballast").unlink()
        if restart:
            daemon.start()
            # Read from the start's log: the retry may be done before a ctl could look.
            assert daemon.wait_event("spool_recovered")["messages"] == 1
        home.wait_for(lambda: len(home.messages) == 1, timeout=20)
        assert "x@example.org" in home.messages[0].content.decode(errors="replace")
        wait_for(lambda: not daemon.messages(), what="the original to go")


def test_a_bounce_with_recipients_still_pending_is_not_lost_with_a_stop(start_daemon, small_fs):
    """One recipient bounces while another is still deferred, and the disk is too full for
    the DSN until after a stop: the record that shows the bounce must not be journaled
    before its DSN is, or the restart would find the recipient done and no DSN made."""
    with MailNet(["127.0.0.2", "127.0.0.3", "127.0.0.9"]) as net:
        mx, later, home = net.peers
        net.add_domain("example.org", "127.0.0.2")
        net.add_domain("example.net", "127.0.0.3")
        net.add_domain("sender.test", "127.0.0.9")
        mx.on("rcpt", "451 4.3.0 try later")
        later.on("rcpt", "451 4.3.0 try later")
        daemon = start_daemon(*net.daemon_overrides(), *FAST, "spool.min_free=0", workdir=small_fs)
        queue_id = daemon.send(
            "app@sender.test", ["x@example.org", "y@example.net"], body("b", size=90_000)
        )
        wait_for(lambda: len(events(daemon, "delivery")) >= 2, what="the first attempts")
        st = os.statvfs(small_fs)
        (small_fs / "ballast").write_bytes(b"x" * (st.f_bavail * st.f_frsize - 40_000))
        mx.on("rcpt", "550 5.1.1 no such user")
        wait_for(lambda: events(daemon, "dsn_failed"), what="the DSN refused")
        assert daemon.stop() == 0  # the DSN is still not stored; y is still pending
        (small_fs / "ballast").unlink()
        daemon.start()
        home.wait_for(lambda: len(home.messages) == 1, timeout=20)
        assert "x@example.org" in home.messages[0].content.decode(errors="replace")
        (message,) = daemon.messages().values()
        states = {r["address"]: r["state"] for r in message["recipients"]}
        assert states == {"x@example.org": "bounced", "y@example.net": "deferred"}
        assert daemon.messages().keys() == {queue_id}


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


@pytest.mark.parametrize("file_after", ["0s", "60s"])
def test_write_error_answers_451_and_recovers(start_daemon, file_after):
    """A message file that cannot be written: its message is refused 451. A small one's
    file may wait (spool/filing.py): then the journal holds it, it is answered 250, and
    its file is written once the disk takes it again (here, at stop)."""
    daemon = start_daemon(f"spool.file_after={file_after}", "delivery.enabled=false")
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
    if file_after == "0s":
        assert code == 451 and "4.3.0" in reply
    else:
        assert code == 250
    assert send(daemon, body("after"))[0] == 250
    assert len(daemon.messages()) == (2 if file_after == "0s" else 3)
    assert daemon.stop() == 0
    layout = SpoolLayout(daemon.spool)
    for queue_id in journal.replay(layout.journal, repair=False).state.messages:
        assert layout.message_path(queue_id).exists()


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
    # A file the journal does not know (its record lost, or a crash before the journal
    # append), one that is not a message file at all, and an interrupted temp file.
    unknown = IdGenerator().next(time.time() - 60)
    record = Message(unknown, "app@example.com", (Recipient("b@example.org"),), 1e9, 6, "p1")
    layout.message_path(unknown).write_bytes(b"".join(file_parts(record, b"hello\r\n")))
    bogus = "0" * 6 + kept[6:9] + "0" * 7
    layout.message_path(bogus).write_bytes(b"MTQ1 never acknowledged")
    layout.tmp_path(bogus).write_bytes(b"half")
    # A torn record at the end of the journal.
    (segment,) = sorted(layout.journal.glob("*.log"))[-1:]
    with segment.open("ab") as journal_file:
        journal_file.write(b"\x40\x00\x00\x00torn")

    daemon.start()
    recovered = daemon.wait_event("spool_recovered")
    assert recovered["dropped_bytes"] == 8 and recovered["skipped_frames"] == 0
    swept = daemon.wait_event("spool_swept")
    assert (swept["adopted"], swept["temp_removed"], swept["quarantined"]) == (1, 1, 2)
    damage = daemon.wait_event("spool_damaged")  # one event, at error level, with counts
    assert damage["level"] == "error"
    assert (damage["messages_readopted"], damage["files_quarantined"]) == (1, 2)
    assert any(
        line.startswith(f"{damaged}: ") and "checksum" in line for line in damage["quarantined"]
    )
    assert (layout.quarantine / damaged).exists() and (layout.quarantine / bogus).exists()
    assert not layout.tmp_path(bogus).exists()
    time.sleep(0.5)
    assert set(daemon.messages()) == {kept, unknown}
    # The daemon goes on journaling after the cut tail.
    fresh = daemon.send("app@example.com", ["a@example.org"], body("fresh"))
    daemon.restart()
    assert set(daemon.messages()) == {kept, unknown, fresh}
    assert events(daemon, "spool_damaged") == []  # repaired: nothing left to report


def flip_in_snapshot(layout: SpoolLayout) -> None:
    (path,) = layout.journal.glob("*.log")
    data = bytearray(path.read_bytes())
    data[len(data) // 4] ^= 0x01  # the snapshot is the first half of the segment
    path.write_bytes(bytes(data))


def cut_at_three_quarters(layout: SpoolLayout) -> None:
    (path,) = layout.journal.glob("*.log")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4])


def delete_journal(layout: SpoolLayout) -> None:
    for path in layout.journal.glob("*.log"):
        path.unlink()


def undecodable_frame(layout: SpoolLayout) -> None:
    (path,) = layout.journal.glob("*.log")
    payload = b"\x92\x09\xc0"  # intact, but a record this version does not know
    frame = struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    data = path.read_bytes()
    at = 0
    while at < len(data) // 2:  # to a frame boundary near the middle
        at += 8 + struct.unpack_from("<I", data, at)[0]
    path.write_bytes(data[:at] + frame + data[at:])


@pytest.mark.parametrize(
    "damage", [flip_in_snapshot, cut_at_three_quarters, delete_journal, undecodable_frame]
)
def test_a_damaged_journal_loses_nothing_that_is_on_disk(start_daemon, damage):
    daemon = start_daemon()
    acked = [daemon.send("app@example.com", ["a@example.org"], body(f"a{i}")) for i in range(15)]
    removed = acked.pop(0)
    assert daemon.ctl("delete", removed).returncode == 0
    daemon.restart()  # a second segment: the first run's is left as it is
    daemon.restart()  # the writer's start merges the two: the journal is a snapshot, then appends
    acked += [daemon.send("app@example.com", ["a@example.org"], body(f"b{i}")) for i in range(15)]
    assert daemon.stop() == 0
    layout = SpoolLayout(daemon.spool)
    assert len(list(layout.journal.glob("*.log"))) == 1
    damage(layout)

    daemon.start()  # never dies on it
    wait_for(lambda: set(daemon.messages()) == set(acked), what="every acked message")
    event = daemon.wait_event("spool_damaged", timeout=20)
    assert event["level"] == "error"
    assert event["files_quarantined"] == 0 and event["readopt_failed"] == 0
    assert event["frames_skipped"] + event["messages_readopted"] > 0
    if damage is delete_journal:
        assert event["journal_missing"] and event["messages_readopted"] == len(acked)
    if damage in (flip_in_snapshot, undecodable_frame):
        assert event["frames_skipped"] == 1 and event["damage"]
    assert removed not in daemon.messages()
    daemon.restart()
    assert set(daemon.messages()) == set(acked)
