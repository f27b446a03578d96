"""The spool writer's protocol: the operations the daemon sends, and what it answers.

    Batch(ops, events=None, keys={}) -> BatchResult(outcomes, last_event, unfiled, filed)
    ops: Accept, Update, Remove, Adopt, Place, Emit, and Suppress / Unsuppress (journal
    records as they are); an outcome per op: OK, or FULL / ERROR followed by why.
    unfiled: the batch's accepts whose content only the journal holds for now, and
    filed: the messages whose files were written since the last answer (writer.py).

Framed msgpack over the socketpair (framing.py); one batch in flight at a time
(writer.py makes it durable, writer_link.py is the daemon's end).
"""

from __future__ import annotations

import msgspec

from ..dkim.signature import PendingSignature
from ..events.event import Event
from ..model import Message
from .records import Suppress, Unsuppress


class Accept(msgspec.Struct, tag=0, array_like=True, frozen=True):
    message: Message
    content: bytes
    # DKIM signature values to make in `content` before it is written (dkim/service.py).
    signatures: list[PendingSignature] = []


class Update(msgspec.Struct, tag=1, array_like=True, frozen=True):
    message: Message


class Remove(msgspec.Struct, tag=2, array_like=True, frozen=True):
    id: str
    reason: str
    final: Message | None = None  # the last record, when it was not journaled (its events)


class Adopt(msgspec.Struct, tag=6, array_like=True, frozen=True):
    """A message whose file is already in place: make the file and a Put of it durable.

    For a file the journal does not know (the start-up sweep), and, after a writer
    died, for each accept it had in flight: whatever of it reached the disk, the file
    decides. Never for a message with a tombstone: that would bring it back.
    """

    message: Message


class Place(msgspec.Struct, tag=7, array_like=True, frozen=True):
    """A new message whose file the daemon wrote whole as `<ID>.tmp` (streamed as it
    arrived): fsync it and rename it into place, then as for an accept.

    Sent again as it is if the writer died meanwhile: a file already renamed (by the
    writer that died, after its fsync) is then taken as it is, as for an adopt.
    """

    message: Message


class Emit(msgspec.Struct, tag=8, array_like=True, frozen=True):
    """Events that change no state (an address refused at RCPT): journaled and logged."""

    events: list[Event]


# Suppression list changes are journal records as they are (tags 4 and 5).
Op = Accept | Update | Remove | Suppress | Unsuppress | Adopt | Place | Emit


class Batch(msgspec.Struct, array_like=True, frozen=True):
    ops: list[Op]
    # None: no events are made; else each class's expiry action, for "expired" events.
    events: dict[str, str] | None = None
    # DKIM keys (id -> PEM) this writer has not been given yet, for the Accepts' signatures.
    keys: dict[str, bytes] = {}


# An outcome per op: "" = durable, "full:<text>" = no space, "error:<text>" = I/O error.
# A result with fewer outcomes than ops means the writer could not read the batch.
class BatchResult(msgspec.Struct, array_like=True, frozen=True):
    outcomes: list[str]
    last_event: int = 0  # the seq of the newest event in the event log
    # Accepted without a file for now: the daemon keeps their content until it is filed.
    unfiled: list[str] = []
    filed: list[str] = []  # files written since the last answer (or, first, at start)


OK = ""
FULL = "full:"
ERROR = "error:"
