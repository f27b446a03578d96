"""What the listener's process and the daemon say to each other, one frame each (`framing`).

    encode(message) -> bytes           decode_up(payload) / decode_down(payload) -> message

Up (listener → daemon): `Commit` a message held whole, or `Open`, `Piece`s and `Close` one
written as it arrives (`Discard` forgets it); `RcptRefused` for each suppressed recipient
refused (the daemon emits its event); `State` whenever sessions, stress or sheds change
(not per message: the daemon counts the commits itself); `Bound` once, with the addresses
listened on, after "ready"; `Reloaded` after each `Reload`.
Down (daemon → listener): `Committed` (the queue id; a streamed message's stored size),
`Written` (a piece is on disk), `Refused` (storage full or failing: the reply the client
gets); `Storage` when the spool's refusal changes; `Suppressions` (the suppression list:
all of it first, then each change); `Reload` (read the config again, as the daemon did);
`Drain` (stop listening, finish sessions within `grace`, then exit).

Tokens pair an answer with its request; the listener's process numbers them.
"""

from __future__ import annotations

import msgspec

from ..dkim.signature import PendingSignature
from ..model import Message
from ..spool.records import Suppress


class Commit(msgspec.Struct, tag=1, array_like=True):
    token: int
    message: Message
    content: bytes
    signatures: list[PendingSignature]


class Open(msgspec.Struct, tag=2, array_like=True):
    token: int
    message: Message
    header: bytes  # for the DKIM signer, which sees the content as it is written
    now: float
    data: bytes  # the content so far, the header first


class Piece(msgspec.Struct, tag=3, array_like=True):
    token: int
    data: bytes


class Close(msgspec.Struct, tag=4, array_like=True):
    token: int
    data: bytes  # the last of the content


class Discard(msgspec.Struct, tag=5, array_like=True):
    token: int


class RcptRefused(msgspec.Struct, tag=6, array_like=True):
    address: str
    reason: str
    now: float


class State(msgspec.Struct, tag=7, array_like=True):
    sessions: int
    stress: int
    shed: int


class Bound(msgspec.Struct, tag=8, array_like=True):
    addresses: list[str]


class Reloaded(msgspec.Struct, tag=9, array_like=True):
    pass


class Committed(msgspec.Struct, tag=20, array_like=True):
    token: int
    queue_id: str
    size: int


class Written(msgspec.Struct, tag=21, array_like=True):
    token: int


class Refused(msgspec.Struct, tag=22, array_like=True):
    token: int
    full: bool  # the disk is full (452 4.3.1), else a failed write (451 4.3.0)
    error: str


class Storage(msgspec.Struct, tag=23, array_like=True):
    refusal: str | None


class Suppressions(msgspec.Struct, tag=24, array_like=True):
    entries: list[Suppress]
    removed: list[str]


class Reload(msgspec.Struct, tag=25, array_like=True):
    pass


class Drain(msgspec.Struct, tag=26, array_like=True):
    grace: float


Up = Commit | Open | Piece | Close | Discard | RcptRefused | State | Bound | Reloaded
Down = Committed | Written | Refused | Storage | Suppressions | Reload | Drain

encode = msgspec.msgpack.Encoder().encode
decode_up = msgspec.msgpack.Decoder(Up).decode
decode_down = msgspec.msgpack.Decoder(Down).decode
