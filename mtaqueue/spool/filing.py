"""The writer's message files: written before a message's 250, or once they are due.

    filing = Filing(layout, file_after=5.0)
    filing.add_keys(pems)                       DKIM keys (Batch.keys)
    filing.may_wait(accept, batch_bytes) -> bool    this accept's file may wait (below)
    filing.place(ops) -> outcomes               accepts' files written, places' moved,
                                                adopts' synced (OK, FULL..., ERROR...)
    filing.sync_file(queue_id) -> outcome       a file in place made durable
    filing.sync_dirs(ids) -> {id: outcome}      each touched directory fsynced once
    filing.waiting(queue_id, size, since)       its content is durable in the journal only
    filing.due(now, everything=False) -> ids    waiting files to write now, oldest first
    filing.write_waiting(items) -> ids          write those (id, record, content): the ids
                                                whose files are durable
    filing.filed(ids) / filing.gone(queue_id)   no longer waiting: written / message gone
    filing.next_due(now) -> seconds | None, filing.waiting_bytes
    filing.close()

A relay delivers most mail within a second of taking it. A file per message costs the file
system an inode allocated and freed, a data and a directory fsync, a rename and an unlink:
most of the writer's time (bench/RESULTS.md). So a small unsigned accept is journaled with
its content (records.Unfiled) and its file waits `file_after` seconds: a message delivered
by then never has one. Past that, or at stop, the file is written as at acceptance, and a
`Filed` record says so. The journal's copy is as durable as a file (the 250 still follows
its fdatasync); what waits is bounded (WAIT_MAX_BYTES, each message at most
WAIT_MAX_SIZE), so the daemon, which keeps the content of a waiting file for its
delivery, holds at most that much. A signed accept is written at once: its signature
values are made here, and the daemon does not hold the signed content.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..dkim.keys import PrivateKey, load_private
from ..dkim.signature import PendingSignature, fill
from .batch import ERROR, FULL, OK, Accept, Adopt, Place
from .durable import fsync_dir, fsync_path, is_disk_full, write_all
from .layout import SpoolLayout
from .message_file import encoded_file_parts, file_parts

IO_THREADS = 4
# What may wait for its file: the journal holds it meanwhile, and the daemon keeps it.
WAIT_MAX_SIZE = 64 * 1024
WAIT_MAX_BYTES = 16 * 1024 * 1024


class Filing:
    def __init__(self, layout: SpoolLayout, file_after: float) -> None:
        self.layout = layout
        self.file_after = file_after
        self.waiting_bytes = 0
        self._waiting: dict[str, tuple[float, int]] = {}  # id -> (since, size), oldest first
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="spool-io")
        self._keys: dict[str, PrivateKey | str] = {}  # DKIM key id -> key, or why not

    def add_keys(self, pems: dict[str, bytes]) -> None:
        """DKIM keys to sign with (Batch.keys). One that does not load fails the messages
        it would sign, not the batch (the daemon checked it: a file changed since?)."""
        for key_id, pem in pems.items():
            try:
                self._keys[key_id] = load_private(pem)
            except (ValueError, TypeError) as exc:
                self._keys[key_id] = f"DKIM key {key_id} does not load: {exc}"

    # -- files written now ------------------------------------------------------------

    def may_wait(self, op: Accept, batch_bytes: int) -> bool:
        """An accept whose file may wait: small, unsigned, and room left to hold it
        beside the `batch_bytes` of its batch's accepts already let wait."""
        if op.signatures or self.file_after <= 0:
            return False
        size = len(op.content)
        return size <= WAIT_MAX_SIZE and self.waiting_bytes + batch_bytes + size <= WAIT_MAX_BYTES

    def place(self, ops: list[Accept | Adopt | Place]) -> list[str]:
        """The files of these ops made durable (but their directories), from several
        threads at once: concurrent fsyncs share the file system's journal commits."""
        return list(self._pool.map(self._place, ops))

    def _place(self, op: Accept | Adopt | Place) -> str:
        if isinstance(op, Accept):
            return self._write(op)
        return self._move(op) if isinstance(op, Place) else self.sync_file(op.message.id)

    def _write(self, op: Accept) -> str:
        content = op.content
        if op.signatures:
            try:
                content = fill(content, op.signatures, self._signing_keys(op.signatures))
            except (KeyError, ValueError) as exc:  # a bug: refused (451), never unsigned
                return f"{ERROR}cannot sign: {exc}"
        return self._write_parts(op.message.id, file_parts(op.message, content))

    def _write_parts(self, queue_id: str, parts: tuple[bytes, ...]) -> str:
        """temp file, write, fsync, rename: the file appears whole or not at all."""
        tmp = self.layout.tmp_path(queue_id)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            return outcome_of(exc)
        try:
            try:
                write_all(fd, *parts)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.layout.message_path(queue_id))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            return outcome_of(exc)
        return OK

    def _signing_keys(self, signatures: list[PendingSignature]) -> dict[str, PrivateKey]:
        keys = {}
        for item in signatures:
            key = self._keys.get(item.key_id, f"DKIM key {item.key_id} was never given")
            if isinstance(key, str):
                raise KeyError(key)
            keys[item.key_id] = key
        return keys

    def _move(self, op: Place) -> str:
        """fsync, rename: the file the daemon wrote appears whole or not at all."""
        tmp = self.layout.tmp_path(op.message.id)
        try:
            fsync_path(tmp)
            os.rename(tmp, self.layout.message_path(op.message.id))
        except FileNotFoundError:
            return self.sync_file(op.message.id)  # renamed by a writer that died, or never written
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            return outcome_of(exc)
        return OK

    def sync_file(self, queue_id: str) -> str:
        """The file in place made durable (an adopt's, written by someone else)."""
        # A temp file is an interrupted write (the rename comes after its fsync).
        self.layout.tmp_path(queue_id).unlink(missing_ok=True)
        try:
            fsync_path(self.layout.message_path(queue_id))
        except FileNotFoundError:
            return f"{ERROR}message file {queue_id} is not on disk"
        except OSError as exc:
            return outcome_of(exc)
        return OK

    def sync_dirs(self, ids: list[str]) -> dict[str, str]:
        """Each directory of these messages' new files fsynced once: the ids whose
        directory failed, with why."""
        dirs: dict[Path, list[str]] = {}
        for queue_id in ids:
            dirs.setdefault(self.layout.message_dir(queue_id), []).append(queue_id)
        failed = {}
        for directory, members in dirs.items():
            try:
                fsync_dir(directory)
            except OSError as exc:
                failed.update(dict.fromkeys(members, outcome_of(exc)))
        return failed

    # -- files that wait ------------------------------------------------------------------

    def waiting(self, queue_id: str, size: int, since: float) -> None:
        """The message's content is durable in the journal; its file waits."""
        self._waiting[queue_id] = (since, size)
        self.waiting_bytes += size

    def due(self, now: float, everything: bool = False) -> list[str]:
        """The waiting files to write now (or all of them), oldest first."""
        if everything:
            return list(self._waiting)
        limit = now - self.file_after
        due = []
        for queue_id, (since, _) in self._waiting.items():
            if since > limit:
                break
            due.append(queue_id)
        return due

    def next_due(self, now: float) -> float | None:
        """Seconds until the oldest waiting file is due; None: none waits."""
        for since, _ in self._waiting.values():
            return max(0.0, since + self.file_after - now)
        return None

    def write_waiting(self, items: list[tuple[str, bytes, bytes]]) -> list[str]:
        """Write the files of (id, record as accepted, content): the ids whose file and
        directory are durable. One that fails stays waiting, to be tried again."""
        outcomes = list(
            self._pool.map(
                lambda item: self._write_parts(item[0], encoded_file_parts(item[1], item[2])),
                items,
            )
        )
        written = [item[0] for item, outcome in zip(items, outcomes, strict=True) if not outcome]
        failed = self.sync_dirs(written)
        return [queue_id for queue_id in written if queue_id not in failed]

    def filed(self, ids: list[str]) -> None:
        for queue_id in ids:
            self.gone(queue_id)

    def gone(self, queue_id: str) -> None:
        entry = self._waiting.pop(queue_id, None)
        if entry is not None:
            self.waiting_bytes -= entry[1]

    def close(self) -> None:
        self._pool.shutdown()


def outcome_of(exc: OSError) -> str:
    return (FULL if is_disk_full(exc) else ERROR) + str(exc)
