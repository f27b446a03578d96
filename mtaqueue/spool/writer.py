"""The spool writer: a child process that makes every change durable.

Apart from the daemon, its blocking syscalls (open, write, fsync, rename per message) never
wait for the daemon's GIL (in one process, 2,200 fsynced files/s alone, 48/s beside a busy
event loop; bench/RESULTS.md).

Protocol, over a socketpair: the daemon sends a `Batch` of operations, the writer answers with
one `BatchResult` once all of it is durable. One batch is in flight at a time: while the
writer syncs one round the next accumulates in the daemon (the group commit).

Per round: message files are written, fsynced (from several threads at once: concurrent fsyncs
share the file system's journal commits) and renamed into place; each touched directory is
fsynced once; the journal records of the round are appended with one fdatasync. A small
accept's file waits instead (its content goes into the journal with it, filing.py): written
only once it is due, after a round or while idle, and journaled then as Filed. A message too
large to send over the socket comes as a `Place`: the daemon wrote its file as the data
arrived, and the writer fsyncs it and renames it into place like the others.

An accepted message's DKIM signature values are made here, by the thread that writes its file,
just before it does: OpenSSL signs without the GIL, so a round's RSA signatures are made on
both cores, beside the other files' fsyncs (the daemon made the rest of each signature field:
dkim/service.py).
"""

from __future__ import annotations

import argparse
import contextlib
import select
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import msgspec

from .. import heap, memory_trace
from ..events import derive
from ..events.event import Event, msgpack_encoder
from ..framing import frame, split_frames
from ..model import Message
from . import journal
from .batch import (
    ERROR,
    OK,
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
from .durable import fsync_dir, fsync_path
from .event_log import EventLogWriter
from .expiring import prune_period
from .filing import Filing, outcome_of
from .layout import SpoolLayout
from .records import (
    Buried,
    Continues,
    Delete,
    Filed,
    JournalState,
    Noted,
    Put,
    Record,
    Suppress,
    Unfiled,
    Unsuppress,
)

_encoder = msgspec.msgpack.Encoder()


class SpoolWriter:
    """Applies batches to the disk. Synchronous; owns the journal's write end."""

    def __init__(
        self, root: Path, *, compact_size: int, dedupe_window: float, file_after: float = 0.0
    ) -> None:
        self.layout = SpoolLayout(root)
        self.compact_size = compact_size
        self.dedupe_window = dedupe_window
        self.events = EventLogWriter(self.layout.events)
        # The daemon has already repaired the journal; this is a second reading of it,
        # which also gives back the events the event log lost (appended after the
        # journal and synced lazily: a crash can cut its tail).
        replayed = journal.replay(
            self.layout.journal,
            repair=False,
            noted_after=self.events.last_seq,
            keys_after=time.time() - dedupe_window,
        )
        self.state: JournalState = replayed.state
        for event in self.state.noted:
            self.events.append([event], msgspec.msgpack.decode(event, type=Event).seq)
        self.state.noted.clear()
        self.state.noted_after = None
        self.events.sync()
        self.next_seq = max(self.events.last_seq, self.state.last_event_seq) + 1
        # Event ids: unique without a syscall each (a random prefix per writer, then the
        # seq), kept with the event so a repeat carries the same one.
        self._id_prefix = uuid.uuid4().hex[:12] + "-"
        # A writer that died may have left appends that were read just now but never
        # synced; the daemon is about to rely on them (Adopt), so make them durable.
        # (A segment that cannot even be opened was skipped by the replay; the
        # compaction below rewrites everything it read.)
        segments = journal.list_segments(self.layout.journal)
        for path in segments:
            with contextlib.suppress(OSError):
                fsync_path(path)
        self.journal = journal.JournalWriter(self.layout.journal)
        with contextlib.suppress(Exception):  # else a replay keeps tombstones: no harm
            self.journal.append(journal.encode(Continues(max(self.state.messages, default=""))))
        self._base_size = 0  # journal size right after the last compaction
        self._prune_at = 0.0  # time.monotonic() of the next prune
        self.state.filed.clear()  # (for merging segments only)
        self.filing = Filing(self.layout, file_after)
        self.filed: list[str] = []  # files written since the last answer (BatchResult.filed)
        # Mail accepted without its file by a writer before us: filed before anything else.
        for queue_id, (_, content) in self.state.unfiled.items():
            self.filing.waiting(queue_id, len(content), 0.0)
        self.file_due(time.monotonic(), everything=True)
        # Merge the segments left by earlier runs, and rewrite a damaged journal. A
        # single whole segment (the last snapshot and what followed it) is left as it
        # is: rewriting a large queue at every start would delay the first answer for
        # nothing; only its removed messages' files are made sure of (as a compaction
        # would).
        if len(segments) > 1 or replayed.damage:
            self.compact()
        else:
            self._bury()

    def commit(self, ops: list[Op], expire_actions: dict[str, str] | None = None) -> list[str]:
        """Make a batch durable; `expire_actions` given (see Batch.events): with events."""
        outcomes = [OK] * len(ops)
        # Records first: one the journal cannot take fails its op before any file is written.
        records: list[Record | None] = [None] * len(ops)
        frames = [b""] * len(ops)
        noted: list[tuple[int, list[bytes]] | None] = [None] * len(ops)
        latest: dict[str, Message | None] = {}  # the batch's own changes, for the next one
        waiting: dict[int, str] = {}  # the accepts whose file waits (records.Unfiled)
        waiting_bytes = 0
        seq = self.next_seq
        for i, op in enumerate(ops):
            if isinstance(op, Adopt | Place) and op.message.id in self.state.messages:
                # Journaled already (by the writer that died): the file decides, or, if it
                # waits, the journal's content (written now).
                if op.message.id in self.state.unfiled:
                    outcomes[i] = self._file_now(op.message.id)
                continue
            if isinstance(op, Adopt | Place) and op.message.id in self.state.deleted:
                outcomes[i] = f"{ERROR}message {op.message.id} was removed"
                continue
            if type(op) is Accept and self.filing.may_wait(op, waiting_bytes):
                rec: Record | None = Unfiled(msgspec.Raw(_encoder.encode(op.message)), op.content)
                waiting[i] = op.message.id
                waiting_bytes += len(op.content)
            else:
                rec = _record(op)
            events = [] if expire_actions is None else self._events(op, latest, expire_actions)
            try:
                if events:
                    stamped = [
                        msgpack_encoder.encode(
                            msgspec.structs.replace(
                                e, id=f"{self._id_prefix}{seq + n:x}", seq=seq + n
                            )
                        )
                        for n, e in enumerate(events)
                    ]
                    body = journal.payload_of(rec) if rec is not None else b""
                    frames[i] = journal.encode(Noted(seq, stamped, body))
                    noted[i] = (seq, stamped)
                    seq += len(stamped)
                else:
                    frames[i] = journal.encode(rec) if rec is not None else b""
            except Exception as exc:
                outcomes[i] = f"{ERROR}cannot journal: {exc}"
            else:
                records[i] = rec
        placing = [
            (i, op)
            for i, op in enumerate(ops)
            if isinstance(op, Accept | Adopt | Place) and not outcomes[i] and i not in waiting
        ]
        written = []  # (index, id) of the files made durable
        placed = self.filing.place([op for _, op in placing])
        for (i, op), outcome in zip(placing, placed, strict=True):
            if outcome:
                outcomes[i] = outcome
            else:
                written.append((i, op.message.id))
        failed = self.filing.sync_dirs([queue_id for _, queue_id in written])
        for i, queue_id in written:
            if queue_id in failed:
                outcomes[i] = failed[queue_id]
        written = [(i, queue_id) for i, queue_id in written if queue_id not in failed]

        done = [i for i, outcome in enumerate(outcomes) if not outcome]
        data = b"".join(frames[i] for i in done)
        if data:
            try:
                self.journal.append(data)
            except Exception as exc:
                failure = outcome_of(exc) if isinstance(exc, OSError) else f"{ERROR}{exc!r}"
                for i, queue_id in written:  # never acknowledged: do not leave them behind
                    # An adopted file was there before (else re-adopted at the next start).
                    if isinstance(ops[i], Accept | Place) and records[i] is not None:
                        with contextlib.suppress(OSError):
                            self.layout.message_path(queue_id).unlink(missing_ok=True)
                return [outcome or failure for outcome in outcomes]
        # Durable from here on: nothing below may fail the batch.
        self.next_seq = seq  # an op that failed leaves a gap in the numbers, no event
        self._log_events([noted[i] for i in done if noted[i] is not None])
        now = time.monotonic()
        for i in done:
            rec = records[i]
            if rec is None:
                continue
            if type(rec) is Delete and rec.id in self.state.unfiled:
                self.filing.gone(rec.id)  # it never had a file
            elif type(rec) is Delete:
                with contextlib.suppress(OSError):  # the tombstone stays until _bury manages
                    self.layout.message_path(rec.id).unlink(missing_ok=True)
            self.state.apply(rec)
            if type(rec) is Unfiled:
                self.filing.waiting(waiting[i], len(rec.content), now)
        self.file_due(now)
        if self.journal.size > max(self.compact_size, 2 * self._base_size):
            self.compact()
        elif now >= self._prune_at:
            self.prune()
        return outcomes

    def waiting_files(self, ops: list[Op], outcomes: list[str]) -> list[str]:
        """Of a batch just answered, the accepts whose files wait (BatchResult.unfiled)."""
        unfiled = self.state.unfiled
        return [
            op.message.id
            for op, outcome in zip(ops, outcomes, strict=True)
            if type(op) is Accept and not outcome and op.message.id in unfiled
        ]

    def file_due(self, now: float, everything: bool = False) -> None:
        """Write the files that are due (or all that wait), then journal that they are."""
        due = self.filing.due(now, everything)
        if not due:
            return
        unfiled = self.state.unfiled
        written = self.filing.write_waiting([(i, *unfiled[i]) for i in due])
        if not written:
            return
        try:
            self.journal.append(journal.encode(Filed(written)))
        except Exception:
            # Still waiting, as far as a replay knows (written again later): a file left
            # behind now would outlive its message's Delete, which needs no tombstone.
            for queue_id in written:
                with contextlib.suppress(OSError):
                    self.layout.message_path(queue_id).unlink(missing_ok=True)
            return
        self.state.apply(Filed(written))
        self.filing.filed(written)
        self.filed += written

    def _file_now(self, queue_id: str) -> str:
        """The file of an adopt that waits (journaled by a writer that died), written now."""
        self.file_due(time.monotonic(), everything=True)
        if queue_id in self.state.unfiled:
            return f"{ERROR}message file {queue_id} could not be written"
        return OK

    def _events(
        self, op: Op, latest: dict[str, Message | None], expire_actions: dict[str, str]
    ) -> list[Event]:
        """The events of an op; a bug in making them costs the events, never the change."""
        try:
            return self._derive(op, latest, expire_actions)
        except Exception as exc:
            print(
                f"mtaqueue-spool-writer: no events for {type(op).__name__}: {exc!r}",
                file=sys.stderr,
                flush=True,
            )
            return []

    def _derive(
        self, op: Op, latest: dict[str, Message | None], expire_actions: dict[str, str]
    ) -> list[Event]:
        """The events of an op, against the last record of its message journaled (or
        changed earlier in the same batch)."""
        now = time.time()
        if isinstance(op, Emit):
            return op.events
        if isinstance(op, Suppress):
            return [derive.suppressed(op.address, op.reason, now)]
        if isinstance(op, Unsuppress):
            return []
        queue_id = op.id if isinstance(op, Remove) else op.message.id
        before = latest[queue_id] if queue_id in latest else self.state.messages.get(queue_id)
        if isinstance(op, Remove):
            latest[queue_id] = None
            if before is None:
                return []
            return derive.removed(before, op.final, op.reason, now, expire_actions)
        latest[queue_id] = op.message
        if before is None:
            return derive.accepted(op.message, now)
        return derive.changed(before, op.message, now, expire_actions)

    def _log_events(self, batch: list[tuple[int, list[bytes]]]) -> None:
        """Append the durable batch's events to the event log. A failure here loses
        nothing: the journal has them, and the next writer appends them."""
        try:
            for first_seq, events in batch:
                self.events.append(events, first_seq)
            self.events.sync_if_due()
        except OSError:
            pass

    def prune(self) -> None:
        """Forget what a compaction would (buried tombstones, keys of closed windows, ended
        suppressions): memory follows the queue, not the journal's size."""
        now = time.time()
        self._prune_at = time.monotonic() + prune_period(self.dedupe_window)
        self._bury()
        self.state.forget_before(now, now - self.dedupe_window)
        heap.trim()

    def compact(self) -> None:
        self.prune()
        try:
            self.events.sync()  # the journal's copy of the events goes with the compaction
            journal.compact(self.journal, self.state)
        except Exception:
            return  # tried again after a later round; the old segments are intact
        self._base_size = self.journal.size

    def _bury(self) -> None:
        """Make sure the files of deleted messages are gone for good, so that the next
        snapshot may forget their Delete records: a file that outlived its record would
        be re-adopted. Unlinked again because after a restart nobody knows which
        unlinks happened; a directory fsync makes them durable. Then a `Buried` says so
        in the journal, so that a replay forgets those tombstones as it reads."""
        gone: list[str] = []
        dirs: dict[Path, list[str]] = {}
        for queue_id in self.state.deleted:
            try:
                self.layout.message_path(queue_id).unlink(missing_ok=True)
            except OSError:
                continue  # the tombstone stays in the snapshot
            dirs.setdefault(self.layout.message_dir(queue_id), []).append(queue_id)
        for directory, buried in dirs.items():
            try:
                fsync_dir(directory)
            except OSError:
                continue
            for queue_id in buried:
                del self.state.deleted[queue_id]
            gone += buried
        if gone:
            # Lost in a crash, or failed: the tombstones come back, to be buried again.
            with contextlib.suppress(Exception):
                self.journal.append(journal.encode(Buried(gone)))

    def close(self) -> None:
        """At stop every waiting file is written: a stopped spool has one per message."""
        with contextlib.suppress(Exception):
            self.file_due(time.monotonic(), everything=True)
        self.filing.close()
        self.journal.close()
        self.events.close()


def _record(op: Op) -> Record | None:
    if isinstance(op, Remove):
        return Delete(op.id, op.reason)
    if isinstance(op, Emit):
        return None
    if isinstance(op, Accept | Update | Adopt | Place):
        return Put(op.message)
    return op


def serve(sock: socket.socket, writer: SpoolWriter) -> None:
    """Answer batches until the daemon closes its end."""
    decoder = msgspec.msgpack.Decoder(Batch)
    encoder = msgspec.msgpack.Encoder()
    buffer, chunk = bytearray(), memoryview(bytearray(1 << 20))  # (a new MiB a recv: churn)
    while True:
        # Idle, the files that wait are written when due (answered with the next batch).
        idle = writer.filing.next_due(time.monotonic())
        if idle is not None and not select.select([sock], [], [], idle)[0]:
            writer.file_due(time.monotonic())
            continue
        size = sock.recv_into(chunk)
        if not size:
            return
        buffer += chunk[:size]
        for payload in split_frames(buffer):
            ops, outcomes = _answer(writer, decoder, payload)
            unfiled = writer.waiting_files(ops, outcomes)
            result = BatchResult(outcomes, writer.events.last_seq, unfiled, writer.filed)
            writer.filed = []
            sock.sendall(frame(encoder.encode(result)))


def _answer(
    writer: SpoolWriter, decoder: msgspec.msgpack.Decoder, payload: bytes
) -> tuple[list[Op], list[str]]:
    """A batch and its outcomes. A bug fails its batch, it does not end the writer: the
    daemon answers 451 for it and goes on with the next one."""
    try:
        batch = decoder.decode(payload)
    except msgspec.DecodeError:
        return [], []
    ops = batch.ops
    try:
        writer.filing.add_keys(batch.keys)
        return ops, writer.commit(ops, batch.events)
    except Exception as exc:
        return ops, [f"{ERROR}spool writer failed: {exc!r}"] * len(ops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtaqueue-spool-writer")
    parser.add_argument("root")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--compact-size", type=int, required=True)
    parser.add_argument("--dedupe-window", type=float, required=True)
    parser.add_argument("--file-after", type=float, default=0.0)
    args = parser.parse_args(argv)
    # The daemon ends us by closing the socket, after its last batch: a signal
    # meant for the daemon (Ctrl-C, a reload's SIGHUP, systemd's SIGTERM to the
    # group) must not cut a round in half.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    memory_trace.install("writer", Path(args.root) / "tracemalloc")
    heap.one_arena()  # before SpoolWriter starts its I/O threads
    sock = socket.socket(fileno=args.fd)
    writer = SpoolWriter(
        Path(args.root),
        compact_size=args.compact_size,
        dedupe_window=args.dedupe_window,
        file_after=args.file_after,
    )
    sock.sendall(frame(b"ready"))
    try:
        serve(sock, writer)
    except ConnectionError:
        pass  # the daemon died (EPIPE or ECONNRESET); everything we answered for is on disk
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
