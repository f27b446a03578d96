"""The frames between the listener's process and the daemon: every kind goes through as it
was, and bytes that are not a frame of ours fail as a decoding error, never otherwise."""

import contextlib

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaqueue.dkim.signature import PendingSignature
from mtaqueue.model import Message, Recipient
from mtaqueue.smtp import handover as h
from mtaqueue.spool.records import Suppress

MESSAGE = Message(
    id="661FE08184E88001",
    sender="app@sender.test",
    recipients=(Recipient("a@example.org"),),
    created=1_800_000_000.5,
    size=120,
    klass="p0",
)


def test_every_kind_of_frame_comes_out_as_it_went_in():
    up = [
        h.Commit(1, MESSAGE, b"Subject: x\r\n\r\nhi\r\n", [PendingSignature("k1", b"\x01", 7)]),
        h.Open(2, MESSAGE, b"Subject: x\r\n\r\n", 1.5, b"Subject: x\r\n\r\nbody"),
        h.Piece(2, b"more"),
        h.Close(2, b"end\r\n"),
        h.Discard(3),
        h.RcptRefused("gone@example.org", "550 5.1.1 no such user", 2.0),
        h.State(3, 1, 2),
        h.Bound(["127.0.0.1:2525"]),
    ]
    down = [
        h.Committed(1, "661FE08184E88001", 120),
        h.Written(2),
        h.Refused(2, True, "No space left on device"),
        h.Storage("452 4.3.1 Insufficient system storage"),
        h.Storage(None),
        h.Suppressions([Suppress("gone@example.org", 3.0, "bounced")], ["back@example.org"]),
        h.Reload(),
        h.Drain(30.0),
    ]
    assert [h.decode_up(h.encode(m)) for m in up] == up
    assert [h.decode_down(h.encode(m)) for m in down] == down


FRAMES = [
    h.encode(m)
    for m in (
        h.Commit(1, MESSAGE, b"x", []),
        h.Open(2, MESSAGE, b"h", 1.0, b"hd"),
        h.Committed(1, "661FE08184E88001", 9),
        h.Suppressions([Suppress("a@b.c", 1.0, "r")], []),
    )
]


@st.composite
def damaged(draw) -> bytes:
    """A frame of ours with bytes changed, cut short or added, or bytes at random."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    frame = bytearray(draw(st.sampled_from(FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(frame) - 1))
        frame[at] = draw(st.integers(0, 255))
    return bytes(frame[: draw(st.integers(0, len(frame)))]) + draw(st.binary(max_size=8))


@settings(max_examples=1000)
@given(damaged())
def test_bytes_that_are_no_frame_of_ours_fail_as_a_decoding_error(data):
    for decode in (h.decode_up, h.decode_down):
        with contextlib.suppress(msgspec.MsgspecError):
            decode(data)
