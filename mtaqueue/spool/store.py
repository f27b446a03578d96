"""The spool as the daemon sees it: the queue index plus a link to the writer.

`open()` locks the spool, rebuilds the queue from the journal and spawns the
writer process (writer.py), which makes every change durable. The
daemon's changes are queued here and sent as one batch whenever the writer is
idle; each change's future resolves only once the writer has synced it, so a
250 reply never precedes the disk. The index (`messages`) is updated on the
event loop when a batch comes back.

A message too large to hold is written to its file by the daemon as it arrives
(`incoming()`, in a few threads of the daemon's, so that the event loop never
waits for the disk); the writer then only syncs and renames that file (`Place`).

If the writer dies, it is started again (with a backoff if it keeps dying) and
nothing waiting is lost: of the batch it had in flight, the accepts are asked of
the new writer (is the file on disk?) and the other changes are sent again
(they are idempotent). Meanwhile new mail is refused (`refusal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from ..child_process import ChildLink, abandon, start_child
from ..dkim.signature import PendingSignature
from ..events.event import Event
from ..framing import frame
from ..ids import IdGenerator
from ..logs import get_logger
from ..model import Message
from . import journal
from .durable import is_disk_full
from .layout import SpoolLayout
from .message_file import MessageFileWriter, read_content
from .records import MessageMap, Suppress, Unsuppress, dedupe_key
from .writer import (
    ERROR,
    FULL,
    Accept,
    Adopt,
    Batch,
    BatchResult,
    Emit,
    Op,
    Place,
    Remove,
    Update,
)

log = get_logger("spool")

WRITER_START_TIMEOUT = 60.0
# A writer that ran this long before dying is restarted at once; one that dies sooner
# waits, twice as long each time, up to the cap.
WRITER_STABLE = 30.0
WRITER_BACKOFF_FIRST = 0.5
WRITER_BACKOFF_MAX = 30.0
# Changes per batch to the writer: a bulk change (`mtaqueue-ctl release --all` at a
# million queued) is encoded, committed and answered in steps this size, none of which
# holds the event loop long.
MAX_BATCH = 5000
STREAM_THREADS = 4  # the daemon's threads writing the files of incoming messages
WRITER_DOWN = "451 4.3.0 Spool writer restarting, try again later"
DISK_LOW = "452 4.3.1 Insufficient system storage"


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
    dropped_bytes: int  # a torn tail, cut off
    skipped_frames: int
    skipped_bytes: int
    damage: list[str]
    seconds: float
    deleted: set[str] = field(default_factory=set)  # tombstones, for the sweep


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
        self.messages = MessageMap()  # the queue, held encoded (records.py)
        self.keys: dict[str, tuple[str, float]] = {}  # dedupe_key -> (id, created)
        self.suppressed: dict[str, Suppress] = {}  # lower-cased address -> entry
        self.ids = IdGenerator()
        self.free_bytes = 0
        self.disk_ok = True  # above spool.min_free
        self.on_commit: Callable[[Message], None] | None = None
        # Events: None = none are made; else each class's expiry action (writer.Batch).
        self.events: dict[str, str] | None = None
        self.last_event = 0  # seq of the newest event in the event log
        self.on_events: Callable[[int], None] | None = None
        self.signing_keys: dict[str, bytes] = {}  # DKIM key id -> PEM (SigningService.pems)
        self._pending_keys: dict[str, asyncio.Future] = {}
        self._queue: list[tuple[Op, asyncio.Future]] = []
        self._inflight: list[tuple[Op, asyncio.Future]] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(BatchResult)
        self._link: _WriterLink | None = None  # set while a writer is up and ready
        self._process: asyncio.subprocess.Process | None = None
        self._restarting: asyncio.Task | None = None
        self._writer_since = 0.0  # monotonic: when the current writer became ready
        self._down_since: float | None = None  # monotonic: when the last writer died
        self._backoff = 0.0
        self._progress = 0.0  # monotonic: last answer from the writer, or work began waiting
        self._closed = False
        self._lock_fd = -1
        self._io = ThreadPoolExecutor(STREAM_THREADS, thread_name_prefix="spool-stream")

    @property
    def refusal(self) -> str | None:
        """Why new mail cannot be taken now, as the SMTP reply; None when it can."""
        if self._link is None:
            return WRITER_DOWN
        return None if self.disk_ok else DISK_LOW

    @property
    def storage_ok(self) -> bool:
        return self.refusal is None

    def stalled_for(self, now: float) -> float:
        """Seconds for which changes have waited without the writer answering any, or
        the writer has been down (`now` is time.monotonic())."""
        waiting = now - self._progress if self._queue or self._inflight is not None else 0.0
        down = now - self._down_since if self._down_since is not None else 0.0
        return max(waiting, down)

    # -- start and stop ----------------------------------------------------------

    async def open(self) -> RecoveryReport:
        """Lock the spool, rebuild the queue from the journal and start the writer.

        The writer reads the journal too, in its own process, while we do: at a large
        queue each reading takes seconds, side by side rather than one after the other.
        So that it reads what we read, the segments are opened before it starts (one it
        deletes by compacting stays readable), and our repairs (the torn tail cut off,
        the segments older than the last snapshot deleted) wait until it is ready.
        """
        started = time.monotonic()
        self.layout.create()
        self._lock()
        segments = journal.open_segments(self.layout.journal)
        try:
            reading = asyncio.ensure_future(
                asyncio.to_thread(
                    journal.replay, self.layout.journal, repair=False, segments=segments
                )
            )
            try:
                await self._spawn()
            finally:
                result = await reading
        finally:
            journal.close_segments(segments)
        journal.cut_torn_tail(result)
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
            skipped_frames=result.skipped_frames,
            skipped_bytes=result.skipped_bytes,
            damage=result.damage,
            seconds=time.monotonic() - started,
            deleted=set(result.state.deleted),
        )

    async def _spawn(self) -> None:
        link = _WriterLink(self)
        args = [str(self.layout.root), "--compact-size", str(self._compact_size)]
        args += ["--dedupe-window", str(self.dedupe_window)]
        process = await start_child("mtaqueue.spool.writer", args, link)
        try:
            await asyncio.wait_for(link.ready, WRITER_START_TIMEOUT)
        except BaseException as exc:
            # Not ready in time, died while starting, or we are closing.
            await abandon(process, link.transport)
            if isinstance(exc, TimeoutError | ConnectionError | RuntimeError):
                raise StorageError(f"spool writer did not start: {exc!r}") from None
            raise
        self._link, self._process = link, process
        self._writer_since = time.monotonic()
        self._down_since = None

    def _writer_lost(self, link: _WriterLink) -> None:
        if link is not self._link:
            return  # one that failed to start, or the one close() ended
        self._link = None
        self._down_since = time.monotonic()
        self._restarting = asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            # It closed its end: it is dead or dying. Its threads must be gone before
            # a new writer looks at the files it may have been writing.
            try:
                await asyncio.wait_for(process.wait(), 5.0)
            except TimeoutError:
                process.kill()
                await process.wait()
        lived = time.monotonic() - self._writer_since
        self._backoff = 0.0 if lived >= WRITER_STABLE else self._longer_backoff()
        log.critical(
            "spool_writer_lost",
            returncode=process.returncode if process else None,
            in_flight=len(self._inflight or ()),
            queued=len(self._queue),
            restart_in=self._backoff,
        )
        while True:
            await asyncio.sleep(self._backoff)
            try:
                await self._spawn()
                break
            except Exception as exc:  # whatever it is, giving up would refuse mail for good
                self._backoff = self._longer_backoff()
                log.error("spool_writer_start_failed", error=repr(exc), retry_in=self._backoff)
        self._restarting = None
        # The batch in flight may or may not have reached the disk. For its accepts the
        # new writer looks at the files (and journals those it finds); the other
        # changes are sent again.
        inflight, self._inflight = self._inflight or [], None
        again = [(Adopt(op.message) if isinstance(op, Accept) else op, f) for op, f in inflight]
        self._queue = again + self._queue
        log.warning("spool_writer_restarted", resent=len(again))
        self._send()

    def _longer_backoff(self) -> float:
        return min(max(2 * self._backoff, WRITER_BACKOFF_FIRST), WRITER_BACKOFF_MAX)

    async def close(self, timeout: float) -> bool:
        """Commit what is queued (for up to `timeout` seconds), end the writer, release
        the spool. False if changes had to be given up."""
        deadline = time.monotonic() + timeout
        while (self._queue or self._inflight is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._closed = True
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restarting
        left = (self._inflight or []) + self._queue
        self._inflight, self._queue = None, []
        for op, future in left:
            self._fail(op, future, StorageError("spool closed"))
        if left:
            log.error("spool_close_incomplete", given_up=len(left))
        link, self._link = self._link, None
        if link is not None and link.transport is not None:
            link.transport.close()  # EOF: the writer finishes its round and exits
        if self._process is not None:
            # Killing it past the deadline loses nothing: what it answered is durable,
            # and a crash mid-round (or mid-compaction) is one that recovery handles.
            await _end(self._process, max(deadline - time.monotonic(), 0.2))
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        # Pieces still queued are written (or their files removed) by the threads as they
        # finish; a file left half written is a temp file, which the next start removes.
        self._io.shutdown(wait=False)
        return not left

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

    def accept(
        self, message: Message, content: bytes, signatures: list[PendingSignature] | None = None
    ) -> asyncio.Future:
        """Make a new message durable; the future yields its queue id. `signatures`: the
        DKIM signature values for the writer to make in `content` (their keys' PEMs in
        `signing_keys`).

        A message whose idempotency key was seen within the dedupe window is not
        stored again: the future yields the first message's id.
        """
        return self._new(Accept(message, content, signatures or []))

    def incoming(self, message: Message, signer: ContentSigner | None = None) -> IncomingMessage:
        """A new message to write as its content arrives (data too large to hold); a
        `signer` sees it as it is written and gives the fields to put before it."""
        return IncomingMessage(self, message, signer)

    def key_holder(self, key: str, tenant: str | None) -> str | None:
        """The id of the newest message accepted with this idempotency key (of this
        tenant) while the index still has it; it may have left the queue since."""
        seen = self.keys.get(dedupe_key(key, tenant) or key)
        return None if seen is None else seen[0]

    def duplicate_of(self, message: Message) -> str | None:
        """The id a new message is answered with if its idempotency key (of its tenant) was
        accepted within the dedupe window: the first message's."""
        key = dedupe_key(message.idempotency_key, message.tenant)
        seen = None if key is None else self.keys.get(key)
        if seen is None or seen[1] + self.dedupe_window <= message.created:
            return None
        return seen[0]

    def _new(self, op: Accept | Place) -> asyncio.Future:
        message = op.message
        key = dedupe_key(message.idempotency_key, message.tenant)
        if key is not None:
            seen = self.duplicate_of(message)
            if seen is not None:
                future = asyncio.get_running_loop().create_future()
                future.set_result(seen)
                return future
            pending = self._pending_keys.get(key)
            if pending is not None:
                return pending
        if self._restarting is not None:  # refused at once, not held for an unknown time
            future = asyncio.get_running_loop().create_future()
            future.set_exception(StorageError("spool writer restarting"))
            return future
        future = self._enqueue(op)
        if key is not None:
            self._pending_keys[key] = future
        return future

    def adopt(self, message: Message) -> asyncio.Future:
        """Journal a message whose file is on disk but unknown to the journal (the
        start-up sweep); once durable it is queued like a new one."""
        return self._enqueue(Adopt(message))

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
        self.messages.put(message)
        return self._enqueue(Update(message))

    def show(self, message: Message) -> None:
        """Change a queued message's record in memory only: a restart finds the last one
        journaled (a finished message waiting for its DSN, to be tried again then)."""
        if message.id in self.messages:
            self.messages.put(message)

    def remove(self, queue_id: str, reason: str, final: Message | None = None) -> asyncio.Future:
        """Journal the end of a message, then delete its file (leaves the queue at once).
        `final`: its last record, if that was not journaled (what its events tell)."""
        self.messages.pop(queue_id)
        return self._enqueue(Remove(queue_id, reason, final if self.events is not None else None))

    def emit(self, events: list[Event]) -> None:
        """Events that change no state, journaled and logged with the next batch (when
        events are made at all); a failure is the writer's to log."""
        if self.events is not None:
            self._enqueue(Emit(events))

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
        if self._closed:
            future.set_exception(StorageError("spool closed"))
            return future
        if not self._queue and self._inflight is None:
            self._progress = time.monotonic()  # work waits from now on
        self._queue.append((op, future))
        self._send()
        return future

    def _send(self) -> None:
        """Send what is queued as one batch, unless one is in flight or no writer is up."""
        if self._inflight is not None or not self._queue or self._link is None:
            return
        transport = self._link.transport
        if transport is None:
            return
        batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
        keys = self._link.keys_for([op for op, _ in batch], self.signing_keys)
        try:
            payload = self._encoder.encode(Batch([op for op, _ in batch], self.events, keys))
        except Exception:
            batch = self._encodable(batch)
            if not batch:
                return
            payload = self._encoder.encode(Batch([op for op, _ in batch], self.events, keys))
        self._inflight = batch
        transport.write(frame(payload))

    async def committed(self) -> None:
        """Until every change asked for so far is answered by the writer (durable, or
        failed): for one made by someone else's call (the delivery manager's)."""
        pending = [future for _, future in (*self._queue, *(self._inflight or ()))]
        if pending:
            await asyncio.wait(pending)

    async def drained(self) -> None:
        """Until fewer than a batch of changes wait to be sent: a bulk change waits here
        between its steps, so that what it queues stays bounded (not a million records
        held for the writer at once)."""
        while len(self._queue) >= MAX_BATCH and not self._closed:
            await asyncio.sleep(0.01)

    def _encodable(self, batch: list[tuple[Op, asyncio.Future]]) -> list[tuple[Op, asyncio.Future]]:
        """The changes of a batch that encode; the others fail alone (a bug upstream,
        such as a string msgpack cannot hold, must not take the spool down with it)."""
        good = []
        for op, future in batch:
            try:
                self._encoder.encode(op)
            except Exception as exc:
                log.error("spool_unencodable", op=type(op).__name__, error=repr(exc))
                self._fail(op, future, StorageError(f"cannot be stored: {exc}"))
            else:
                good.append((op, future))
        return good

    def _answered(self, payload: bytes) -> None:
        """A batch is durable (or failed): publish it, then send the next one."""
        batch, self._inflight = self._inflight or [], None
        self._progress = time.monotonic()
        try:
            result = self._decoder.decode(payload)
        except msgspec.DecodeError:
            outcomes = []
        else:
            outcomes = result.outcomes
            if result.last_event > self.last_event:
                self.last_event = result.last_event
                if self.on_events is not None:
                    self.on_events(result.last_event)
        if len(outcomes) != len(batch):
            outcomes = [f"{ERROR}the spool writer could not read the batch"] * len(batch)
        try:
            self.refresh_free_space()
        except OSError as exc:
            log.error("spool_statvfs_failed", error=str(exc))
        for (op, future), outcome in zip(batch, outcomes, strict=True):
            try:
                self._resolve(op, future, outcome)
            except Exception as exc:  # a bug here must not strand the rest of the batch
                log.exception("spool_resolve_failed", op=type(op).__name__)
                if not future.done():
                    future.set_exception(StorageError(repr(exc)))
        self._send()

    def _resolve(self, op: Op, future: asyncio.Future, outcome: str) -> None:
        if outcome:
            text = outcome.partition(":")[2]
            self._fail(
                op, future, StorageFull(text) if outcome.startswith(FULL) else StorageError(text)
            )
            return
        self._forget_pending_key(op, future)
        if isinstance(op, Remove):
            result = op.id
        elif isinstance(op, Suppress):
            self.suppressed[op.address] = op
            result = op.address
        elif isinstance(op, Unsuppress):
            self.suppressed.pop(op.address, None)
            result = op.address
        elif isinstance(op, Emit):
            result = None
        else:
            result = op.message.id
        if not future.done():
            future.set_result(result)
        if isinstance(op, Accept | Adopt | Place):  # durable: queued, whoever still waits
            message = op.message
            self.messages.put(message)
            key = dedupe_key(message.idempotency_key, message.tenant)
            if key is not None:
                self.keys[key] = (message.id, message.created)
            if self.on_commit is not None:
                self.on_commit(message)

    def _fail(self, op: Op, future: asyncio.Future, exc: Exception) -> None:
        self._forget_pending_key(op, future)
        if not future.done():
            future.set_exception(exc)

    def _forget_pending_key(self, op: Op, future: asyncio.Future) -> None:
        if isinstance(op, Accept | Adopt | Place):
            key = dedupe_key(op.message.idempotency_key, op.message.tenant)
            if key is not None and self._pending_keys.get(key) is future:
                del self._pending_keys[key]


class ContentSigner(Protocol):
    """Sees a streamed message's content as it is written (in the spool's threads), then
    gives the fields that go before it (a DKIM signature: `dkim.signer.StreamSigning`)."""

    def feed(self, data: bytes) -> None: ...

    def fields(self) -> bytes: ...


class IncomingMessage:
    """A new message written to its spool file as its content arrives.

    `write()` the content piece by piece, each once the last is written (the futures
    say so), then `commit()` or `discard()` it. The disk work runs in the spool's
    threads; a file that is not committed is removed (a crash leaves a temp file, which
    the start-up sweep removes)."""

    def __init__(self, spool: Spool, message: Message, signer: ContentSigner | None) -> None:
        self.message = message  # its record; its size is set by commit()
        self._spool = spool
        self._file = MessageFileWriter(spool.layout.tmp_path(message.id))
        self._signer = signer

    def write(self, *parts: bytes) -> asyncio.Future:
        """Append content; the future fails with StorageFull or StorageError."""
        return self._in_thread(self._write, *parts)

    def commit(self, last: bytes) -> asyncio.Future:
        """Append the last content, then make the message durable as `Spool.accept()`
        does (with the same answers: the queue id, or a duplicate's first id)."""
        result = asyncio.get_running_loop().create_future()

        def finish() -> None:
            self._write(last)
            head = b"" if self._signer is None else self._signer.fields()
            size = len(head) + self._file.length
            self.message = msgspec.structs.replace(self.message, size=size)
            self._file.finish(self.message, head)

        def finished(future: asyncio.Future) -> None:
            if future.exception() is not None:
                self.discard()
                result.set_exception(future.exception())
            else:
                self._spool._new(Place(self.message)).add_done_callback(placed)

        def placed(future: asyncio.Future) -> None:
            exc = future.exception()
            if exc is not None or future.result() != self.message.id:
                self.discard()  # not stored, or a duplicate of one that is
            if exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(future.result())

        self._in_thread(finish).add_done_callback(finished)
        return result

    def _write(self, *parts: bytes) -> None:
        if self._signer is not None:
            for part in parts:
                self._signer.feed(part)
        self._file.write(*parts)

    def discard(self) -> None:
        """Forget it: its file is removed (in the background)."""
        with contextlib.suppress(RuntimeError):  # closed: the next start removes the file
            self._spool._io.submit(self._file.discard)

    def _in_thread(self, call: Callable[..., None], *args: bytes) -> asyncio.Future:
        def run() -> None:
            try:
                call(*args)
            except OSError as exc:
                raise (StorageFull if is_disk_full(exc) else StorageError)(str(exc)) from None

        return asyncio.get_running_loop().run_in_executor(self._spool._io, run)


async def _end(process: asyncio.subprocess.Process, timeout: float) -> None:
    """Wait for the writer to exit; kill it if it does not within `timeout` (stuck)."""
    try:
        await asyncio.wait_for(process.wait(), timeout)
        return
    except TimeoutError:
        pass
    log.error("spool_writer_killed", pid=process.pid)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    # Even SIGKILL waits for a syscall stuck in the kernel: do not wait forever.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), 1.0)


class _WriterLink(ChildLink):
    """The daemon's end of the socketpair to the writer."""

    def __init__(self, spool: Spool) -> None:
        super().__init__("spool writer")
        self.spool = spool
        self.keys_given: set[str] = set()  # DKIM key ids this writer has

    def keys_for(self, ops: list[Op], pems: dict[str, bytes]) -> dict[str, bytes]:
        """The keys to send with a batch of these ops: those it signs with that this
        writer has not been given (a new writer is given them again)."""
        if not pems:  # no DKIM keys: nothing to look for in the batch
            return {}
        wanted = {p.key_id for op in ops if isinstance(op, Accept) for p in op.signatures}
        new = {key_id: pems[key_id] for key_id in wanted - self.keys_given if key_id in pems}
        self.keys_given.update(new)
        return new

    def answered(self, payload: bytes) -> None:
        if self.spool._link is self:
            self.spool._answered(payload)

    def lost(self) -> None:
        self.spool._writer_lost(self)
