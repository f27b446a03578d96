"""The spool: durable message files plus the state journal, with group commit.

Every change goes through one committer thread. It takes everything queued
since its last round and makes it durable together: message files are written,
fsynced and renamed into place, each touched directory is fsynced once, then the
journal records of the whole round are appended with a single fdatasync. Only
then are the waiting futures resolved, so a 250 reply never precedes the disk.
Under load many SMTP sessions share one journal flush; there is one thread hop
per round, not per message.

The event loop keeps its own view of the queue (`messages`), updated when a
round completes. The committer keeps a mirror (`JournalState`) to write
compaction snapshots without touching loop-owned data.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..ids import IdGenerator, id_time
from ..model import Message
from . import journal
from .layout import TMP_SUFFIX, SpoolLayout
from .message_file import CorruptMessageFile, prelude_and_header, read_content, read_message_file
from .records import Delete, JournalState, Put


class StorageFull(Exception):
    """No room on the spool's file system (answer 452 4.3.1)."""


class StorageError(Exception):
    """The spool could not be written (answer 451 4.3.0)."""


class SpoolLocked(Exception):
    """Another daemon owns this spool."""


@dataclass
class RecoveryReport:
    messages: int
    journal_records: int
    journal_segments: int
    dropped_bytes: int
    warnings: list[str]
    seconds: float


@dataclass
class SweepReport:
    """What the background consistency sweep found and did."""

    files: int = 0
    orphans_removed: int = 0
    temp_removed: int = 0
    missing: list[str] = field(default_factory=list)
    quarantined: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class _Job:
    kind: str  # "accept", "put" or "delete"
    message: Message | None
    content: bytes | None
    queue_id: str
    reason: str
    future: asyncio.Future
    error: Exception | None = None


class Spool:
    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        min_free: Callable[[int], int],
        compact_size: int,
        dedupe_window: float,
    ) -> None:
        self.layout = SpoolLayout(root)
        self._min_free = min_free  # total bytes of the file system -> bytes to keep free
        self._compact_size = compact_size
        self.dedupe_window = dedupe_window
        self.messages: dict[str, Message] = {}
        self.keys: dict[str, tuple[str, float]] = {}  # idempotency key -> (id, created)
        self.ids = IdGenerator()
        self.free_bytes = 0
        self.storage_ok = True
        self.on_commit: Callable[[Message], None] | None = None
        self._pending_keys: dict[str, asyncio.Future] = {}
        self._state = JournalState()
        self._writer: journal.JournalWriter | None = None
        self._base_size = 0  # journal size right after the last compaction
        self._jobs: list[_Job] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock_fd = -1

    # -- start and stop ----------------------------------------------------------

    def open(self) -> RecoveryReport:
        """Lock the spool and rebuild the queue from the journal (blocking)."""
        started = time.monotonic()
        self.layout.create()
        self._lock()
        result = journal.replay(self.layout.journal)
        for path in result.obsolete:
            path.unlink(missing_ok=True)
        self._state = result.state
        self.messages = dict(result.state.messages)
        self.keys = dict(result.state.keys)
        if self.messages:
            self.ids.advance_past(max(self.messages))
        self._writer = journal.JournalWriter(self.layout.journal)  # starts a fresh segment
        self.refresh_free_space()
        return RecoveryReport(
            messages=len(self.messages),
            journal_records=result.records,
            journal_segments=result.segments,
            dropped_bytes=result.dropped_bytes,
            warnings=list(result.warnings),
            seconds=time.monotonic() - started,
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="spool-committer", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Commit what is queued, stop the committer, release the spool."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self._writer is not None:
            self._writer.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _lock(self) -> None:
        fd = os.open(self.layout.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolLocked(f"spool {self.layout.root} is in use by another mtaqueue") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    # -- the loop-side API ---------------------------------------------------------

    def accept(self, message: Message, content: bytes) -> asyncio.Future:
        """Make a new message durable; the future yields its queue id.

        A message whose idempotency key was seen within the dedupe window is not
        stored again: the future yields the first message's id.
        """
        key = message.idempotency_key
        if key is not None:
            seen = self.keys.get(key)
            if seen is not None and seen[1] + self.dedupe_window > message.created:
                return self._resolved(seen[0])
            pending = self._pending_keys.get(key)
            if pending is not None:
                return pending
        future = self._enqueue("accept", message, content, message.id, "")
        if key is not None:
            self._pending_keys[key] = future
        return future

    def update(self, message: Message) -> asyncio.Future:
        """Journal a changed record of a queued message."""
        return self._enqueue("put", message, None, message.id, "")

    def remove(self, queue_id: str, reason: str) -> asyncio.Future:
        """Journal the end of a message, then delete its file."""
        return self._enqueue("delete", None, None, queue_id, reason)

    def content(self, queue_id: str) -> bytes:
        """The stored content (blocking read; call from a worker thread)."""
        return read_content(self.layout.message_path(queue_id))

    def refresh_free_space(self) -> None:
        st = os.statvfs(self.layout.root)
        self.free_bytes = st.f_bavail * st.f_frsize
        self.storage_ok = self.free_bytes > self._min_free(st.f_blocks * st.f_frsize)

    def journal_size(self) -> int:
        return self._writer.size if self._writer is not None else 0

    def _enqueue(
        self, kind: str, message: Message | None, content: bytes | None, queue_id: str, reason: str
    ) -> asyncio.Future:
        assert self._loop is not None, "spool not started"
        future = self._loop.create_future()
        job = _Job(kind, message, content, queue_id, reason, future)
        with self._cv:
            self._jobs.append(job)
            if len(self._jobs) == 1:
                self._cv.notify()
        return future

    def _resolved(self, value: str) -> asyncio.Future:
        assert self._loop is not None
        future = self._loop.create_future()
        future.set_result(value)
        return future

    def _completed(self, jobs: list[_Job]) -> None:
        """Runs on the loop: publish a committed round."""
        for job in jobs:
            if job.kind == "accept" and job.message is not None:
                key = job.message.idempotency_key
                if key is not None and self._pending_keys.get(key) is job.future:
                    del self._pending_keys[key]
            if job.future.done():
                continue
            if job.error is not None:
                job.future.set_exception(job.error)
                continue
            if job.kind == "delete":
                self.messages.pop(job.queue_id, None)
            else:
                assert job.message is not None
                self.messages[job.queue_id] = job.message
                if job.message.idempotency_key is not None:
                    self.keys[job.message.idempotency_key] = (job.queue_id, job.message.created)
                if job.kind == "accept" and self.on_commit is not None:
                    self.on_commit(job.message)
            job.future.set_result(job.queue_id)

    # -- the committer thread ---------------------------------------------------------

    def _run(self) -> None:
        assert self._loop is not None
        if len(list(self.layout.journal.glob("*.log"))) > 1:
            self._compact()  # merge the segments left by earlier runs
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                jobs, self._jobs = self._jobs, []
                if not jobs and self._stopping:
                    return
            try:
                self._commit(jobs)
            except Exception as exc:  # never let the committer die with futures waiting
                for job in jobs:
                    job.error = job.error or StorageError(f"spool commit failed: {exc!r}")
            self._loop.call_soon_threadsafe(self._completed, jobs)

    def _commit(self, jobs: list[_Job]) -> None:
        written = self._write_files([j for j in jobs if j.kind == "accept"])
        records = []
        for job in jobs:
            if job.error is None:
                if job.kind == "delete":
                    records.append(Delete(job.queue_id, job.reason))
                else:
                    records.append(Put(job.message))
        if records:
            try:
                assert self._writer is not None
                self._writer.append(b"".join(journal.encode(r) for r in records))
            except OSError as exc:
                error = _storage_error(exc)
                for job in jobs:
                    job.error = job.error or error
                for path in written:  # never acknowledged: do not leave them behind
                    path.unlink(missing_ok=True)
                return
            for record in records:
                self._state.apply(record)
        for job in jobs:
            if job.kind == "delete" and job.error is None:
                self.layout.message_path(job.queue_id).unlink(missing_ok=True)
        self.refresh_free_space()
        assert self._writer is not None
        if self._writer.size > max(self._compact_size, 2 * self._base_size):
            self._compact()

    def _write_files(self, jobs: list[_Job]) -> list[Path]:
        """Write, fsync and rename the message files of a round; returns the final paths."""
        opened: list[tuple[_Job, int, Path]] = []
        for job in jobs:
            assert job.message is not None and job.content is not None
            tmp = self.layout.tmp_path(job.queue_id)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                job.error = _storage_error(exc)
                continue
            opened.append((job, fd, tmp))
            try:
                _write_all(fd, prelude_and_header(job.message, job.content), job.content)
            except OSError as exc:
                job.error = _storage_error(exc)
        # Syncing after all writes lets the file system flush the round together.
        final: list[Path] = []
        dirs: dict[Path, list[_Job]] = {}
        for job, fd, tmp in opened:
            try:
                if job.error is None:
                    os.fsync(fd)
            except OSError as exc:
                job.error = _storage_error(exc)
            finally:
                os.close(fd)
            if job.error is not None:
                tmp.unlink(missing_ok=True)
                continue
            path = tmp.with_suffix("")
            try:
                os.rename(tmp, path)
            except OSError as exc:
                job.error = _storage_error(exc)
                tmp.unlink(missing_ok=True)
                continue
            final.append(path)
            dirs.setdefault(path.parent, []).append(job)
        for directory, members in dirs.items():
            try:
                _fsync_dir(directory)
            except OSError as exc:
                for job in members:
                    job.error = _storage_error(exc)
        return final

    def _compact(self) -> None:
        assert self._writer is not None
        self._state.forget_keys_before(time.time() - self.dedupe_window)
        try:
            journal.compact(self._writer, self._state)
        except OSError:
            return  # retried after the next round; the old segments are intact
        self._base_size = self._writer.size

    # -- background consistency sweep -------------------------------------------------

    def sweep(self, started: float) -> SweepReport:
        """Reconcile message files with the journal (blocking; run in a thread).

        Rules (spool_layout.md): temp files are removed; a file with no journal
        record was never acknowledged and is removed, if it predates `started`
        (newer ones may be commits in flight); a file that cannot be read is moved to
        quarantine; a journaled message without its file is reported as missing.
        """
        report = SweepReport()
        known = set(self._state.messages)
        for directory in self.layout.all_message_dirs():
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            for name in names:
                path = directory / name
                queue_id = name.removesuffix(TMP_SUFFIX)
                if id_time(_id_or_zero(queue_id)) >= started:
                    continue
                report.files += 1
                if name.endswith(TMP_SUFFIX):
                    path.unlink(missing_ok=True)
                    report.temp_removed += 1
                elif queue_id not in known:
                    path.unlink(missing_ok=True)
                    report.orphans_removed += 1
                else:
                    known.discard(queue_id)
                    problem = _check_file(path, queue_id)
                    if problem:
                        self._quarantine(path, queue_id)
                        report.quarantined.append((queue_id, problem))
        report.missing = sorted(
            i for i in known if id_time(i) < started and i in self._state.messages
        )
        return report

    def _quarantine(self, path: Path, queue_id: str) -> None:
        os.replace(path, self.layout.quarantine / queue_id)
        _fsync_dir(self.layout.quarantine)


def _check_file(path: Path, queue_id: str) -> str:
    try:
        message, _ = read_message_file(path)
    except CorruptMessageFile as exc:
        return exc.reason
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    return "" if message.id == queue_id else f"file holds message {message.id}"


def _id_or_zero(name: str) -> str:
    try:
        int(name, 16)
    except ValueError:
        return "0"
    return name


def _write_all(fd: int, head: bytes, content: bytes) -> None:
    written = os.writev(fd, [head, content])
    rest = memoryview(head + content if written < len(head) else content)
    rest = rest[written if written < len(head) else written - len(head) :]
    while rest:  # a short write near a full disk: the next write says ENOSPC
        rest = rest[os.write(fd, rest) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _storage_error(exc: OSError) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(str(exc))
    return StorageError(str(exc))
