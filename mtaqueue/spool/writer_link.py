"""The daemon's link to the spool writer: the child process and the batches it commits.

    link = WriterLink(spool, args)  # spool: the SpoolSide it serves (store.Spool)
    await link.start()              # start the writer (writer.py); raises StorageError
    future = link.send(op)          # a change, sent with the next batch
    link.up, link.restarting, link.stalled_for(now)
    await link.committed(), await link.drained()
    clean = await link.close(timeout)

Changes are queued here and sent as one batch whenever the writer is idle (at most
MAX_BATCH of them); when the writer answers, the batch's outcomes go to the spool
(`SpoolSide.batch_answered`), which resolves each change's future, and the next batch goes.
A batch of changes no client waits on (a delivery's result: no new message among them)
waits up to LAZY_HOLD for company: each round costs the writer a journal fdatasync, and
the next accept's round takes them along.

If the writer dies, it is started again (with a backoff if it keeps dying) and nothing
waiting is lost: of the batch it had in flight, the accepts are asked of the new writer
(is the file on disk?) and the other changes are sent again (they are idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import msgspec

from ..child_process import ChildLink, abandon, start_child
from ..framing import frame
from ..logs import get_logger
from .batch import ERROR, Accept, Adopt, Batch, BatchResult, Op, Place
from .errors import StorageError

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
# How long a batch of changes no client waits on is held while the writer is idle (the
# window in which a crash could forget a delivery, and send it again, grows by as much).
LAZY_HOLD = 0.005

Change = tuple[Op, asyncio.Future]  # a change and the future its caller waits on
Answer = tuple[Op, asyncio.Future, str]  # ... and the writer's outcome (writer.OK, or why not)


class SpoolSide(Protocol):
    """What the link reads of the spool it serves (store.Spool), and what it tells it."""

    events: dict[str, str] | None  # sent with each batch (writer.Batch)
    signing_keys: dict[str, bytes]  # DKIM key id -> PEM, each sent to a writer once

    def batch_answered(self, answers: list[Answer], result: BatchResult) -> None:
        """The writer answered a batch: each change with its outcome, and the result (the
        seq of the newest event in the event log, the files that wait and those written)."""

    def change_failed(self, op: Op, future: asyncio.Future, error: Exception) -> None:
        """A change no batch answers: it cannot be encoded, or the spool closed first."""

    def writer_changed(self) -> None:
        """A writer became ready, or the one that was is gone (`up` changed)."""


class WriterLink:
    def __init__(self, spool: SpoolSide, args: list[str]) -> None:
        self._spool = spool
        self._args = args  # the writer's command line, but for its end of the socketpair
        self._queue: list[Change] = []
        self._inflight: list[Change] | None = None
        self._urgent = False  # a queued change is a new message: its client waits
        self._hold: asyncio.TimerHandle | None = None  # sends the lazy changes held
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(BatchResult)
        self._pipe: _Pipe | None = None  # set while a writer is up and ready
        self._process: asyncio.subprocess.Process | None = None
        self._restarting: asyncio.Task | None = None
        self._writer_since = 0.0  # monotonic: when the current writer became ready
        self._down_since: float | None = None  # monotonic: when the last writer died
        self._backoff = 0.0
        self._progress = 0.0  # monotonic: last answer from the writer, or work began waiting
        self._closed = False

    @property
    def up(self) -> bool:
        """A writer is up and ready."""
        return self._pipe is not None

    @property
    def restarting(self) -> bool:
        """The writer died and a new one is not ready yet."""
        return self._restarting is not None

    def stalled_for(self, now: float) -> float:
        """Seconds for which changes have waited without the writer answering any, or
        the writer has been down (`now` is time.monotonic())."""
        waiting = now - self._progress if self._queue or self._inflight is not None else 0.0
        down = now - self._down_since if self._down_since is not None else 0.0
        return max(waiting, down)

    @property
    def pid(self) -> int | None:
        """The writer process's, while one runs."""
        return None if self._process is None else self._process.pid

    # -- the writer process ------------------------------------------------------------

    async def start(self) -> None:
        pipe = _Pipe(self)
        process = await start_child("mtaqueue.spool.writer", self._args, pipe)
        try:
            await asyncio.wait_for(pipe.ready, WRITER_START_TIMEOUT)
        except BaseException as exc:
            # Not ready in time, died while starting, or we are closing.
            await abandon(process, pipe.transport)
            if isinstance(exc, TimeoutError | ConnectionError | RuntimeError):
                raise StorageError(f"spool writer did not start: {exc!r}") from None
            raise
        self._pipe, self._process = pipe, process
        self._writer_since = time.monotonic()
        self._down_since = None
        self._spool.writer_changed()

    def _lost(self, pipe: _Pipe) -> None:
        if pipe is not self._pipe:
            return  # one that failed to start, or the one close() ended
        self._pipe = None
        self._down_since = time.monotonic()
        self._spool.writer_changed()
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
                await self.start()
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
        self._send(hold=False)

    def _longer_backoff(self) -> float:
        return min(max(2 * self._backoff, WRITER_BACKOFF_FIRST), WRITER_BACKOFF_MAX)

    async def close(self, timeout: float) -> bool:
        """Commit what is queued (for up to `timeout` seconds), then end the writer.
        False if changes had to be given up."""
        deadline = time.monotonic() + timeout
        while (self._queue or self._inflight is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._closed = True
        if self._hold is not None:
            self._hold.cancel()
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restarting
        left = (self._inflight or []) + self._queue
        self._inflight, self._queue = None, []
        for op, future in left:
            self._spool.change_failed(op, future, StorageError("spool closed"))
        if left:
            log.error("spool_close_incomplete", given_up=len(left))
        pipe, self._pipe = self._pipe, None
        if pipe is not None and pipe.transport is not None:
            pipe.transport.close()  # EOF: the writer finishes its round and exits
        if self._process is not None:
            # Killing it past the deadline loses nothing: what it answered is durable,
            # and a crash mid-round (or mid-compaction) is one that recovery handles.
            await _end(self._process, max(deadline - time.monotonic(), 0.2))
        return not left

    # -- the batches ---------------------------------------------------------------------

    def send(self, op: Op) -> asyncio.Future:
        """Queue a change for the writer; the future resolves once it is answered."""
        future = asyncio.get_running_loop().create_future()
        if self._closed:
            future.set_exception(StorageError("spool closed"))
            return future
        if not self._queue and self._inflight is None:
            self._progress = time.monotonic()  # work waits from now on
        self._queue.append((op, future))
        self._urgent = self._urgent or isinstance(op, Accept | Place | Adopt)
        self._send()
        return future

    def _send(self, hold: bool = True) -> None:
        """Send what is queued as one batch, unless one is in flight or no writer is up;
        lazy changes alone (`hold`) go at the end of their hold."""
        if self._inflight is not None or not self._queue or self._pipe is None:
            return
        transport = self._pipe.transport
        if transport is None:
            return
        if hold and not self._urgent and len(self._queue) < MAX_BATCH:
            if self._hold is None:
                self._hold = asyncio.get_running_loop().call_later(LAZY_HOLD, self._held)
            return
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
        self._urgent = self._urgent and bool(self._queue)  # (a rest of a bulk change)
        keys = self._pipe.keys_for([op for op, _ in batch], self._spool.signing_keys)
        events = self._spool.events
        try:
            payload = self._encoder.encode(Batch([op for op, _ in batch], events, keys))
        except Exception:
            batch = self._encodable(batch)
            if not batch:
                return
            payload = self._encoder.encode(Batch([op for op, _ in batch], events, keys))
        self._inflight = batch
        transport.write(frame(payload))

    def _held(self) -> None:
        self._hold = None
        self._send(hold=False)

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

    def _encodable(self, batch: list[Change]) -> list[Change]:
        """The changes of a batch that encode; the others fail alone (a bug upstream,
        such as a string msgpack cannot hold, must not take the spool down with it)."""
        good = []
        for op, future in batch:
            try:
                self._encoder.encode(op)
            except Exception as exc:
                log.error("spool_unencodable", op=type(op).__name__, error=repr(exc))
                self._spool.change_failed(op, future, StorageError(f"cannot be stored: {exc}"))
            else:
                good.append((op, future))
        return good

    def _answered(self, payload: bytes) -> None:
        """A batch is durable (or failed): hand it to the spool, then send the next one."""
        batch, self._inflight = self._inflight or [], None
        self._progress = time.monotonic()
        try:
            result = self._decoder.decode(payload)
        except msgspec.DecodeError:
            result = BatchResult([])
        outcomes = result.outcomes
        if len(outcomes) != len(batch):
            outcomes = [f"{ERROR}the spool writer could not read the batch"] * len(batch)
        answers = [(op, f, outcome) for (op, f), outcome in zip(batch, outcomes, strict=True)]
        self._spool.batch_answered(answers, result)
        self._send()


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


class _Pipe(ChildLink):
    """The daemon's end of the socketpair to one writer process."""

    def __init__(self, link: WriterLink) -> None:
        super().__init__("spool writer")
        self.link = link
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
        if self.link._pipe is self:
            self.link._answered(payload)

    def lost(self) -> None:
        self.link._lost(self)
