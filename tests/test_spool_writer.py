"""The writer process: what reaches the disk, in which order, before it answers; how it
takes faults; and how removals and re-adoption keep each other honest."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time

import msgspec
from dkim_keys import pem, signing_key, verify_all

from mtaqueue.dkim.signer import Signer
from mtaqueue.model import Message, Recipient
from mtaqueue.spool import journal
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.message_file import MessageFileWriter, read_message_file
from mtaqueue.spool.records import Delete
from mtaqueue.spool.sweep import sweep
from mtaqueue.spool.writer import (
    ERROR,
    OK,
    Accept,
    Adopt,
    Batch,
    BatchResult,
    Place,
    Remove,
    SpoolWriter,
    frame,
    serve,
    split_frames,
)

IDS = iter(f"{0x66175AA83CCEC000 + i:016X}" for i in range(1000))


def message() -> Message:
    return Message(
        id=next(IDS),
        sender="app@example.com",
        recipients=(Recipient("a@example.org"),),
        created=time.time(),
        size=5,
        klass="p1",
    )


def writer(layout: SpoolLayout) -> SpoolWriter:
    return SpoolWriter(layout.root, compact_size=1 << 20, dedupe_window=86400.0)


def queued(layout: SpoolLayout) -> set[str]:
    return set(journal.replay(layout.journal, repair=False).state.messages)


def writer_args(theirs: socket.socket) -> list[str]:
    return ["--fd", str(theirs.fileno()), "--compact-size", "1048576", "--dedupe-window", "1"]


def receive(sock: socket.socket) -> bytes:
    buffer = bytearray()
    while True:
        data = sock.recv(1 << 16)
        assert data, "the writer closed the connection instead of answering"
        buffer += data
        frames = split_frames(buffer)
        if frames:
            return frames[0]


def ask(sock: socket.socket, *ops) -> list[str]:
    sock.sendall(frame(msgspec.msgpack.encode(Batch(list(ops)))))
    return msgspec.msgpack.decode(receive(sock), type=BatchResult).outcomes


def streamed(layout: SpoolLayout, record: Message, content: bytes) -> None:
    """What the daemon does with a message too large to hold: its temp file, whole."""
    incoming = MessageFileWriter(layout.tmp_path(record.id))
    incoming.write(content)
    incoming.finish(record)


def test_a_fault_inside_the_writer_fails_its_batch_not_the_writer(layout, monkeypatch):
    spool_writer = writer(layout)
    ours, theirs = socket.socketpair()
    thread = threading.Thread(target=serve, args=(theirs, spool_writer), daemon=True)
    thread.start()
    real = os.fdatasync

    def fail_once(fd: int) -> None:  # a bug, not an I/O error: no OSError
        monkeypatch.setattr(os, "fdatasync", real)
        raise RuntimeError("injected bug")

    monkeypatch.setattr(os, "fdatasync", fail_once)
    failed, failed_placed, later = message(), message(), message()
    streamed(layout, failed_placed, b"placed\r\n")
    outcomes = ask(ours, Accept(failed, b"failed\r\n"), Place(failed_placed))
    assert outcomes[0].startswith(ERROR) and "injected bug" in outcomes[0]
    assert outcomes[1] == outcomes[0]
    for gone in (failed, failed_placed):  # never acknowledged: removed
        assert not layout.message_path(gone.id).exists()
        assert not layout.tmp_path(gone.id).exists()
    assert ask(ours, Accept(later, b"later\r\n")) == [OK]  # the writer goes on
    ours.close()
    thread.join(10)
    spool_writer.close()
    assert queued(layout) == {later.id}


def test_an_accept_in_flight_when_the_writer_died_is_answered_from_the_disk(layout):
    # The dead writer had placed one file but journaled nothing; the other it never began.
    dead = writer(layout)
    placed, lost = message(), message()
    assert dead.filing.place([Accept(placed, b"placed\r\n")]) == [OK]
    dead.layout.tmp_path(lost.id).write_bytes(b"half writ")
    dead.close()
    new = writer(layout)
    outcomes = new.commit([Adopt(placed), Adopt(lost)])
    assert outcomes[0] == OK and "not on disk" in outcomes[1]
    assert not layout.tmp_path(lost.id).exists()
    new.close()
    assert queued(layout) == {placed.id}


def test_a_placed_file_is_taken_as_a_writer_that_died_left_it(layout):
    # The dead writer renamed one file but journaled nothing; another file it never got.
    dead = writer(layout)
    renamed, lost = message(), message()
    streamed(layout, renamed, b"renamed\r\n")
    assert dead.filing.place([Place(renamed)]) == [OK]
    dead.close()
    new = writer(layout)
    outcomes = new.commit([Place(renamed), Place(lost)])
    assert outcomes[0] == OK and "not on disk" in outcomes[1]
    new.close()
    assert queued(layout) == {renamed.id}
    assert read_message_file(layout.message_path(renamed.id)) == (renamed, b"renamed\r\n")


def test_the_writer_makes_the_dkim_signatures_as_it_writes_the_file(layout):
    keys = (signing_key(selector="r"), signing_key("example.com", "e", "ed25519-sha256"))
    content = b"From: <app@example.com>\r\nSubject: hi\r\n\r\nhello\r\n"
    presigned = Signer({"example.com": keys}).prepare(content, time.time())
    assert presigned is not None
    stored = presigned.fields + presigned.content
    signed = msgspec.structs.replace(message(), size=len(stored))
    spool_writer = writer(layout)
    spool_writer.filing.add_keys({key.key_id: pem(key.private) for key in keys})
    assert spool_writer.commit([Accept(signed, stored, presigned.pending)]) == [OK]
    spool_writer.close()
    on_disk = read_message_file(layout.message_path(signed.id))[1]
    assert len(on_disk) == signed.size and b"AAAAAAAA" not in on_disk
    assert verify_all(on_disk, {k.record_name: k.record() for k in keys}) == [True, True]


def test_a_signature_with_a_key_the_writer_was_not_given_fails_its_message_alone(layout):
    key = signing_key()
    content = b"From: <app@example.com>\r\n\r\nhello\r\n"
    presigned = Signer({"example.com": (key,)}).prepare(content, time.time())
    assert presigned is not None
    stored = presigned.fields + presigned.content
    lost, kept = message(), message()
    spool_writer = writer(layout)
    outcomes = spool_writer.commit(
        [Accept(lost, stored, presigned.pending), Accept(kept, b"plain\r\n")]
    )
    spool_writer.close()
    assert outcomes[0].startswith(ERROR) and "cannot sign" in outcomes[0]
    assert outcomes[1] == OK
    assert queued(layout) == {kept.id}


def test_a_removed_message_is_not_brought_back_by_its_file(layout):
    spool_writer = writer(layout)
    gone = message()
    assert spool_writer.commit([Accept(gone, b"gone\r\n")]) == [OK]
    copy = layout.message_path(gone.id).read_bytes()
    assert spool_writer.commit([Remove(gone.id, "delivered")]) == [OK]
    spool_writer.close()
    # A crash lost the unlink (it was not yet durable): the file is back.
    layout.message_path(gone.id).write_bytes(copy)
    replayed = journal.replay(layout.journal)
    assert gone.id in replayed.state.deleted
    report = sweep(layout, set(), replayed.state.deleted, time.time() + 1)
    assert report.adopt == []  # a tombstone: never re-adopted
    restarted = writer(layout)  # removes it for good as it starts
    assert not layout.message_path(gone.id).exists()
    assert restarted.commit([Adopt(gone)])[0].startswith(ERROR)
    restarted.compact()  # so the next snapshot may forget the Delete
    restarted.close()
    assert journal.replay(layout.journal).state.deleted == {}
    assert gone.id not in queued(layout)


def test_a_snapshot_keeps_the_tombstone_while_the_file_cannot_be_removed(layout):
    spool_writer = writer(layout)
    stuck = message()
    spool_writer.commit([Accept(stuck, b"stuck\r\n")])
    path = layout.message_path(stuck.id)
    copy = path.read_bytes()
    spool_writer.commit([Remove(stuck.id, "delivered")])
    path.mkdir()  # unlink() now fails (EISDIR) wherever it is tried
    (path / "x").write_bytes(copy)
    spool_writer.compact()
    spool_writer.close()
    replayed = journal.replay(layout.journal)
    assert replayed.state.deleted == {stuck.id: "delivered"}
    assert Delete(stuck.id, "delivered") in replayed.state.snapshot()


# Records every sync and every answer of the real writer module, in order, with the
# path behind each fd: the only way to see that a sync happened before the 250.
RECORDER = """
import os, socket, sys, threading
log = os.open(sys.argv.pop(1), os.O_WRONLY | os.O_APPEND)
lock = threading.Lock()
def note(what, fd):
    with lock:
        os.write(log, f"{what} {os.readlink(f'/proc/self/fd/{fd}')}\\n".encode())
def wrap(name):
    real = getattr(os, name)
    def synced(fd):
        real(fd)
        note(name, fd)
    setattr(os, name, synced)
wrap("fsync")
wrap("fdatasync")
real_sendall = socket.socket.sendall
def sendall(self, data, *args):
    note("answer", self.fileno())
    return real_sendall(self, data, *args)
socket.socket.sendall = sendall
from mtaqueue.spool import writer
sys.exit(writer.main())
"""


def test_file_directory_and_journal_syncs_all_come_before_the_answer(layout, tmp_path):
    log = tmp_path / "syscalls.log"
    log.write_bytes(b"")
    ours, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, "-c", RECORDER, str(log), str(layout.root), *writer_args(theirs)],
        pass_fds=(theirs.fileno(),),
    )
    theirs.close()
    try:
        assert receive(ours) == b"ready"
        rounds = []
        accepted, placed = message(), message()
        streamed(layout, placed, b"Subject: x\r\n\r\nwritten by the daemon\r\n")
        for op in (Accept(accepted, b"Subject: x\r\n\r\nbody\r\n"), Place(placed)):
            began = len(log.read_text().splitlines())
            assert ask(ours, op) == [OK]
            rounds.append([line.split(" ", 1) for line in log.read_text().splitlines()[began:]])
    finally:
        ours.close()
        child.wait(10)
    for record, calls in zip((accepted, placed), rounds, strict=True):
        steps = [
            ("fsync", str(layout.tmp_path(record.id))),  # the data, before the rename
            ("fsync", str(layout.message_dir(record.id))),  # the rename
            ("fdatasync", str(journal.list_segments(layout.journal)[-1])),  # the record
        ]
        # Each sync happened, in this order, and all before the one answer (the 250).
        assert [call[0] for call in calls].index("answer") == len(calls) - 1
        assert [tuple(call) for call in calls if tuple(call) in steps] == steps


def test_the_writer_exits_quietly_when_the_daemon_dies(layout):
    ours, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, "-m", "mtaqueue.spool.writer", str(layout.root), *writer_args(theirs)],
        pass_fds=(theirs.fileno(),),
        stderr=subprocess.PIPE,
    )
    theirs.close()
    assert receive(ours) == b"ready"
    ours.sendall(frame(msgspec.msgpack.encode(Batch([Accept(message(), b"x\r\n")]))))
    time.sleep(0.5)  # answered; the answer waits unread in our buffer
    ours.close()  # a daemon killed with unread data: the writer's recv gets ECONNRESET
    _, stderr = child.communicate(timeout=10)
    assert child.returncode == 0
    assert stderr == b""


def test_the_snapshot_is_not_written_before_removals_are_durable(layout, monkeypatch):
    spool_writer = writer(layout)
    gone = message()
    spool_writer.commit([Accept(gone, b"gone\r\n")])
    spool_writer.commit([Remove(gone.id, "delivered")])
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        if len(synced) == 1:
            raise OSError(errno.EIO, "injected: directory sync fails")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    spool_writer.compact()
    spool_writer.close()
    # The directory of the removed file could not be synced: the Delete outlives it.
    assert synced[0] == str(layout.message_dir(gone.id))
    assert gone.id in journal.replay(layout.journal).state.deleted


def test_a_start_rewrites_the_journal_only_to_merge_or_repair_it(layout):
    first = writer(layout)
    assert first.commit([Accept(message(), b"x\r\n")]) == [OK]
    first.close()
    (only,) = journal.list_segments(layout.journal)
    kept = only.read_bytes()
    second = writer(layout)  # one whole segment: left as it is, a fresh one follows
    second.close()
    assert journal.list_segments(layout.journal) == [only, second.journal.path]
    assert only.read_bytes() == kept
    third = writer(layout)  # two segments: merged into one snapshot
    third.close()
    assert journal.list_segments(layout.journal) == [third.journal.path]
    assert len(queued(layout)) == 1
