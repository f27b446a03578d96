"""The spool as the daemon sees it: the queue index plus a link to the writer.

`open()` locks the spool and rebuilds the queue from the journal. `start()`
spawns the writer process (writer.py), which makes every change durable. The
daemon's changes are queued here and sent as one batch whenever the writer is
idle; each change's future resolves only once the writer has synced it, so a
250 reply never precedes the disk. The index (`messages`) is updated on the
event loop when a batch comes back.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ..ids import IdGenerator
from ..logs import get_logger
from ..model import Message
from . import journal
from .layout import SpoolLayout
from .message_file import read_content
from .records import Suppress, Unsuppress
from .writer import (
    FULL,
    Accept,
    Batch,
    BatchResult,
    Op,
    Remove,
    Update,
    frame,
    split_frames,
)

log = get_logger("spool")

WRITER_START_TIMEOUT = 60.0


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
        self.suppressed: dict[str, Suppress] = {}  # lower-cased address -> entry
        self.ids = IdGenerator()
        self.free_bytes = 0
        self.disk_ok = True  # above spool.min_free
        self.writer_ok = False
        self.on_commit: Callable[[Message], None] | None = None
        self.on_writer_lost: Callable[[], None] | None = None
        self._pending_keys: dict[str, asyncio.Future] = {}
        self._queue: list[tuple[Op, asyncio.Future]] = []
        self._inflight: list[tuple[Op, asyncio.Future]] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(BatchResult)
        self._link: _WriterLink | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._closing = False
        self._lock_fd = -1

    @property
    def storage_ok(self) -> bool:
        """Whether new mail can be taken: writer alive and enough free space."""
        return self.writer_ok and self.disk_ok

    # -- start and stop ----------------------------------------------------------

    def open(self) -> RecoveryReport:
        """Lock the spool and rebuild the queue from the journal (blocking)."""
        started = time.monotonic()
        self.layout.create()
        self._lock()
        result = journal.replay(self.layout.journal)
        for path in result.obsolete:
            path.unlink(missing_ok=True)
        self.messages = result.state.messages
        self.keys = result.state.keys
        self.suppressed = result.state.suppressed
        if self.messages:
            self.ids.advance_past(max(self.messages))
        self.refresh_free_space()
        return RecoveryReport(
            messages=len(self.messages),
            journal_records=result.records,
            journal_segments=result.segments,
            dropped_bytes=result.dropped_bytes,
            warnings=list(result.warnings),
            seconds=time.monotonic() - started,
        )

    async def start(self) -> None:
        """Spawn the writer and wait until it has read the journal."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mtaqueue.spool.writer",
            str(self.layout.root),
            "--fd",
            str(theirs.fileno()),
            "--compact-size",
            str(self._compact_size),
            "--dedupe-window",
            str(self.dedupe_window),
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        link = _WriterLink(self)
        await loop.create_connection(lambda: link, sock=ours)
        try:
            await asyncio.wait_for(link.ready, WRITER_START_TIMEOUT)
        except (TimeoutError, ConnectionError) as exc:
            raise StorageError(f"spool writer did not start: {exc!r}") from None
        self._link = link
        self.writer_ok = True
        self._send()

    async def close(self) -> None:
        """Commit what is queued, end the writer, release the spool."""
        self._closing = True
        while (self._queue or self._inflight) and self.writer_ok:
            await asyncio.sleep(0.01)
        if self._link is not None and self._link.transport is not None:
            self._link.transport.close()  # EOF: the writer finishes and exits
        if self._process is not None:
            await self._process.wait()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _lock(self) -> None:
        fd = os.open(self.layout.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolLocked(f"spool {self.layout.root} is in use by another mtaqueue") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    # -- changes ---------------------------------------------------------------------

    def accept(self, message: Message, content: bytes) -> asyncio.Future:
        """Make a new message durable; the future yields its queue id.

        A message whose idempotency key was seen within the dedupe window is not
        stored again: the future yields the first message's id.
        """
        key = message.idempotency_key
        if key is not None:
            seen = self.keys.get(key)
            if seen is not None and seen[1] + self.dedupe_window > message.created:
                future = asyncio.get_running_loop().create_future()
                future.set_result(seen[0])
                return future
            pending = self._pending_keys.get(key)
            if pending is not None:
                return pending
        future = self._enqueue(Accept(message, content))
        if key is not None:
            self._pending_keys[key] = future
        return future

    def update(self, message: Message) -> asyncio.Future:
        """Journal a changed record of a queued message.

        Unlike acceptance, the queue shows the change at once: the delivery side
        always reads the latest record, durable or not (a lost update costs at
        worst one more attempt, never a lost message).
        """
        if message.id not in self.messages:  # removed meanwhile: must not come back
            future = asyncio.get_running_loop().create_future()
            future.set_result(message.id)
            return future
        self.messages[message.id] = message
        return self._enqueue(Update(message))

    def remove(self, queue_id: str, reason: str) -> asyncio.Future:
        """Journal the end of a message, then delete its file (leaves the queue at once)."""
        self.messages.pop(queue_id, None)
        return self._enqueue(Remove(queue_id, reason))

    def suppress(self, address: str, until: float, reason: str) -> asyncio.Future:
        return self._enqueue(Suppress(address.lower(), until, reason))

    def unsuppress(self, address: str) -> asyncio.Future:
        return self._enqueue(Unsuppress(address.lower()))

    def suppression(self, address: str, now: float) -> Suppress | None:
        """The active suppression of an address, if any."""
        entry = self.suppressed.get(address.lower())
        return entry if entry is not None and entry.until > now else None

    def content(self, queue_id: str) -> bytes:
        """The stored content (blocking read; call from a worker thread)."""
        return read_content(self.layout.message_path(queue_id))

    def journal_bytes(self) -> int:
        return sum(path.stat().st_size for path in journal.list_segments(self.layout.journal))

    def refresh_free_space(self) -> None:
        st = os.statvfs(self.layout.root)
        self.free_bytes = st.f_bavail * st.f_frsize
        self.disk_ok = self.free_bytes > self._min_free(st.f_blocks * st.f_frsize)

    def _enqueue(self, op: Op) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if not self.writer_ok and self._link is not None:
            future.set_exception(StorageError("spool writer is not running"))
            return future
        self._queue.append((op, future))
        if self._inflight is None:
            self._send()
        return future

    def _send(self) -> None:
        if not self._queue or self._link is None or self._link.transport is None:
            return
        batch, self._queue = self._queue, []
        self._inflight = batch
        payload = self._encoder.encode(Batch([op for op, _ in batch]))
        self._link.transport.write(frame(payload))

    def _answered(self, payload: bytes) -> None:
        """A batch is durable (or failed): publish it, then send the next one."""
        outcomes = self._decoder.decode(payload).outcomes
        batch, self._inflight = self._inflight or [], None
        self.refresh_free_space()
        for (op, future), outcome in zip(batch, outcomes, strict=True):
            if isinstance(op, Accept):
                key = op.message.idempotency_key
                if key is not None and self._pending_keys.get(key) is future:
                    del self._pending_keys[key]
            if future.done():
                continue
            if outcome:
                text = outcome.partition(":")[2]
                future.set_exception(
                    StorageFull(text) if outcome.startswith(FULL) else StorageError(text)
                )
                continue
            if isinstance(op, Remove):
                future.set_result(op.id)
                continue
            if isinstance(op, Suppress):
                self.suppressed[op.address] = op
                future.set_result(op.address)
                continue
            if isinstance(op, Unsuppress):
                self.suppressed.pop(op.address, None)
                future.set_result(op.address)
                continue
            message = op.message
            if isinstance(op, Accept):
                self.messages[message.id] = message
                if message.idempotency_key is not None:
                    self.keys[message.idempotency_key] = (message.id, message.created)
                if self.on_commit is not None:
                    self.on_commit(message)
            future.set_result(message.id)
        self._send()

    def _writer_lost(self) -> None:
        if not self.writer_ok:
            return
        self.writer_ok = False
        if self._closing and not self._queue and not self._inflight:
            return
        log.critical("spool_writer_lost")
        for _, future in (self._inflight or []) + self._queue:
            if not future.done():
                future.set_exception(StorageError("spool writer exited"))
        self._inflight, self._queue = None, []
        self._pending_keys.clear()
        if self.on_writer_lost is not None:
            self.on_writer_lost()


class _WriterLink(asyncio.Protocol):
    """The daemon's end of the socketpair to the writer."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        for payload in split_frames(self._buffer):
            if not self.ready.done():
                self.ready.set_result(None)  # the writer's "ready" frame
            else:
                self.spool._answered(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("spool writer exited while starting"))
        self.spool._writer_lost()
