"""The spool as the daemon sees it: the queue index, and its changes made durable.

    spool = Spool(root, min_free=..., compact_size=..., dedupe_window=..., file_after=...)
    report = await spool.open()          # RecoveryReport; raises SpoolLocked, StorageError
    spool.accept(message, content) / incoming(message) / adopt / update / remove / emit
    spool.suppress / unsuppress / suppression, show(message), content(queue_id)
    spool.prune(now)                     keys past the dedupe window, ended suppressions
    spool.messages, finished, fresh, keys, suppressed, ids, layout, refusal, free_bytes, ...
    await spool.close(timeout)

`open()` locks the spool, rebuilds the queue from the journal and starts the writer
process (writer.py, through writer_link.py), which makes every change durable. Each
change's future resolves only once the writer has synced it, so a 250 reply never
precedes the disk. The index (`messages`) is updated on the event loop when a batch
comes back. A message too large to hold is written to its file by the daemon as it
arrives (`incoming()`, incoming.py). While the writer restarts, new mail is refused
(`refusal`).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..dkim.signature import PendingSignature
from ..events.event import Event
from ..ids import IdGenerator
from ..logs import get_logger
from ..model import Message
from . import journal
from .batch import FULL, Accept, Adopt, BatchResult, Emit, Op, Place, Remove, Update
from .errors import DISK_LOW, WRITER_DOWN, SpoolLocked, StorageError, StorageFull
from .finished import Finished, end_state
from .fresh import FreshContent
from .incoming import ContentSigner, IncomingMessage
from .key_index import KeyIndex
from .layout import SpoolLayout
from .message_file import read_content
from .records import MessageMap, Suppress, Unsuppress, dedupe_key, suppressions
from .writer_link import Answer, WriterLink

log = get_logger("spool")

STREAM_THREADS = 4  # the daemon's threads writing the files of incoming messages


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
        file_after: float = 0.0,
    ) -> None:
        self.layout = SpoolLayout(root)
        self._min_free = min_free  # total bytes of the file system -> bytes to keep free
        self.dedupe_window = dedupe_window
        self.messages = MessageMap()  # the queue, held encoded (records.py)
        self.finished = Finished()  # how recent messages left it (finished.py)
        self.fresh = FreshContent()  # content just accepted, for its delivery (fresh.py)
        self.keys = KeyIndex()  # dedupe_key -> (id, created)
        self.suppressed = suppressions()  # lower-cased address -> entry
        self.ids = IdGenerator()
        self.free_bytes = 0
        self.disk_ok = True  # above spool.min_free
        self.on_commit: Callable[[Message], None] | None = None
        # A suppression added or lifted; `refusal` may have changed (the listener's process
        # keeps a copy of both).
        self.on_suppression: Callable[[Suppress | Unsuppress], None] | None = None
        self.on_refusal: Callable[[], None] | None = None
        # Events: None = none are made; else each class's expiry action (writer.Batch).
        self.events: dict[str, str] | None = None
        self.last_event = 0  # seq of the newest event in the event log
        self.on_events: Callable[[int], None] | None = None
        self.signing_keys: dict[str, bytes] = {}  # DKIM key id -> PEM (SigningService.pems)
        self._pending_keys: dict[str, asyncio.Future] = {}
        writer_args = [str(self.layout.root), "--compact-size", str(compact_size)]
        writer_args += ["--dedupe-window", str(dedupe_window), "--file-after", str(file_after)]
        self._writer = WriterLink(self, writer_args)
        self._lock_fd = -1
        self._io = ThreadPoolExecutor(STREAM_THREADS, thread_name_prefix="spool-stream")

    @property
    def refusal(self) -> str | None:
        """Why new mail cannot be taken now, as the SMTP reply; None when it can."""
        if not self._writer.up:
            return WRITER_DOWN
        return None if self.disk_ok else DISK_LOW

    @property
    def storage_ok(self) -> bool:
        return self.refusal is None

    def stalled_for(self, now: float) -> float:
        """Seconds for which changes have waited without the writer answering any, or
        the writer has been down (`now` is time.monotonic())."""
        return self._writer.stalled_for(now)

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
                    journal.replay,
                    self.layout.journal,
                    repair=False,
                    segments=segments,
                    keys_after=time.time() - self.dedupe_window,
                )
            )
            try:
                await self._writer.start()
            finally:
                result = await reading
        finally:
            journal.close_segments(segments)
        journal.cut_torn_tail(result)
        for path in result.obsolete:
            path.unlink(missing_ok=True)
        self.messages = result.state.messages
        # Mail whose file waited when the last writer stopped: the writer writes those
        # files as it starts (and says so in its first answer); until then, or if it
        # cannot, the journal's copy is the one at hand.
        for queue_id, (_, content) in result.state.unfiled.items():
            self.fresh.pin(queue_id, content)
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

    async def close(self, timeout: float) -> bool:
        """Commit what is queued (for up to `timeout` seconds), end the writer, release
        the spool. False if changes had to be given up."""
        clean = await self._writer.close(timeout)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        # Pieces still queued are written (or their files removed) by the threads as they
        # finish; a file left half written is a temp file, which the next start removes.
        self._io.shutdown(wait=False)
        return clean

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
        return IncomingMessage(
            message,
            signer,
            path=self.layout.tmp_path(message.id),
            io=self._io,
            place=lambda written: self._new(Place(written)),
        )

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
        if self._writer.restarting:  # refused at once, not held for an unknown time
            future = asyncio.get_running_loop().create_future()
            future.set_exception(StorageError("spool writer restarting"))
            return future
        future = self._writer.send(op)
        if key is not None:
            self._pending_keys[key] = future
        return future

    def adopt(self, message: Message) -> asyncio.Future:
        """Journal a message whose file is on disk but unknown to the journal (the
        start-up sweep); once durable it is queued like a new one."""
        return self._writer.send(Adopt(message))

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
        return self._writer.send(Update(message))

    def show(self, message: Message) -> None:
        """Change a queued message's record in memory only: a restart finds the last one
        journaled (a finished message waiting for its DSN, to be tried again then)."""
        if message.id in self.messages:
            self.messages.put(message)

    def remove(self, queue_id: str, reason: str, final: Message | None = None) -> asyncio.Future:
        """Journal the end of a message, then delete its file (leaves the queue at once).
        `final`: its last record, if that was not journaled (what its events tell)."""
        last = final or self.messages.get(queue_id)
        if last is not None:
            self.finished.add(queue_id, end_state(reason, last.recipients), last.tenant)
        self.messages.pop(queue_id)
        self.fresh.drop(queue_id)
        return self._writer.send(
            Remove(queue_id, reason, final if self.events is not None else None)
        )

    def emit(self, events: list[Event]) -> None:
        """Events that change no state, journaled and logged with the next batch (when
        events are made at all); a failure is the writer's to log."""
        if self.events is not None:
            self._writer.send(Emit(events))

    def suppress(self, address: str, until: float, reason: str) -> asyncio.Future:
        return self._writer.send(Suppress(address.lower(), until, reason))

    def unsuppress(self, address: str) -> asyncio.Future:
        return self._writer.send(Unsuppress(address.lower()))

    @property
    def writer_pid(self) -> int | None:
        return self._writer.pid

    def memory_sizes(self) -> dict[str, int]:
        """Entries of the spool's in-memory maps, by name (mtaqueue_memory_entries)."""
        return {
            "queue_messages": len(self.messages),
            "idempotency_keys": len(self.keys),
            "suppressions": len(self.suppressed),
            "finished": len(self.finished),
            "fresh_content": len(self.fresh),
        }

    def prune(self, now: float) -> None:
        """Forget the idempotency keys whose window has closed and the suppressions that
        have ended (the writer forgets them too: SpoolWriter.prune)."""
        self.keys.forget_before(now - self.dedupe_window)
        self.suppressed.forget_before(now)

    def suppression(self, address: str, now: float) -> Suppress | None:
        """The active suppression of an address, if any."""
        entry = self.suppressed.get(address.lower())
        return entry if entry is not None and entry.until > now else None

    def content(self, queue_id: str) -> bytes:
        """The stored content: as accepted if it is still at hand, else read from its file
        (a blocking read of a file in the page cache, mostly)."""
        fresh = self.fresh.get(queue_id)
        return fresh if fresh is not None else read_content(self.layout.message_path(queue_id))

    def journal_bytes(self) -> int:
        return sum(path.stat().st_size for path in journal.list_segments(self.layout.journal))

    def refresh_free_space(self) -> None:
        st = os.statvfs(self.layout.root)
        self.free_bytes = st.f_bavail * st.f_frsize
        disk_ok = self.free_bytes > self._min_free(st.f_blocks * st.f_frsize)
        if disk_ok != self.disk_ok:
            self.disk_ok = disk_ok
            self.writer_changed()

    def writer_changed(self) -> None:
        if self.on_refusal is not None:
            self.on_refusal()

    async def committed(self) -> None:
        """Until every change asked for so far is answered by the writer (durable, or
        failed): for one made by someone else's call (the delivery manager's)."""
        await self._writer.committed()

    async def drained(self) -> None:
        """Until fewer than a batch of changes wait to be sent: a bulk change waits here
        between its steps, so that what it queues stays bounded (not a million records
        held for the writer at once)."""
        await self._writer.drained()

    # -- answers from the writer (writer_link.SpoolSide) ------------------------------

    def batch_answered(self, answers: list[Answer], result: BatchResult) -> None:
        """A batch is durable (or failed): publish it."""
        last_event = result.last_event
        if last_event > self.last_event:
            self.last_event = last_event
            if self.on_events is not None:
                self.on_events(last_event)
        try:
            self.refresh_free_space()
        except OSError as exc:
            log.error("spool_statvfs_failed", error=str(exc))
        waiting = set(result.unfiled)
        for op, future, outcome in answers:
            if waiting and type(op) is Accept and op.message.id in waiting:
                self.fresh.pin(op.message.id, op.content)  # the journal's is its only copy
            try:
                self._resolve(op, future, outcome)
            except Exception as exc:  # a bug here must not strand the rest of the batch
                log.exception("spool_resolve_failed", op=type(op).__name__)
                if not future.done():
                    future.set_exception(StorageError(repr(exc)))
        for queue_id in result.filed:
            self.fresh.unpin(queue_id)

    def _resolve(self, op: Op, future: asyncio.Future, outcome: str) -> None:
        if outcome:
            text = outcome.partition(":")[2]
            self.change_failed(
                op, future, StorageFull(text) if outcome.startswith(FULL) else StorageError(text)
            )
            return
        self._forget_pending_key(op, future)
        if isinstance(op, Remove):
            result = op.id
        elif isinstance(op, Suppress | Unsuppress):
            if isinstance(op, Suppress):
                self.suppressed[op.address] = op
            else:
                self.suppressed.pop(op.address, None)
            if self.on_suppression is not None:
                self.on_suppression(op)
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
            if isinstance(op, Accept) and not op.signatures:  # (else the writer signed it)
                self.fresh.keep(message.id, op.content)
            key = dedupe_key(message.idempotency_key, message.tenant)
            if key is not None:
                self.keys.keep(key, message.id, message.created)
            if self.on_commit is not None:
                self.on_commit(message)

    def change_failed(self, op: Op, future: asyncio.Future, error: Exception) -> None:
        self._forget_pending_key(op, future)
        if not future.done():
            future.set_exception(error)

    def _forget_pending_key(self, op: Op, future: asyncio.Future) -> None:
        if isinstance(op, Accept | Adopt | Place):
            key = dedupe_key(op.message.idempotency_key, op.message.tenant)
            if key is not None and self._pending_keys.get(key) is future:
                del self._pending_keys[key]
