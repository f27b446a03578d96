"""Message data made into content: a message read in pieces cut anywhere the session may
cut (never just after a CR) gets exactly the content and the decisions of the whole."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import example, given, settings
from hypothesis import strategies as st

from mtaqueue.smtp import content
from mtaqueue.smtp.content import Limits, Pieces

_DATA = st.lists(
    st.sampled_from(
        [b"\r\n", b"\r", b"\n", b".", b"..", b"\r\n.", b"\n.", b"\r.", b"\n\n", b"a", b"xyz", b" "]
    ),
    max_size=40,
).map(b"".join)
_ROOMY = Limits(max_size=1 << 20, max_line=1 << 20, window=1 << 20, reject=False)


def pieces_of(data: bytes, cuts: list[int]) -> list[int]:
    """Cut points in `data` (sentinel first) as the session chooses them: past the
    sentinel, never just after a CR."""
    points = {2, len(data)}
    points |= {c for c in cuts if 2 < c < len(data) and data[c - 1 : c] != b"\r"}
    return sorted(points)


@settings(max_examples=500, deadline=None)
@given(raw=_DATA, cuts=st.lists(st.integers(0, 120), max_size=20), crlf=st.booleans())
def test_header_or_body_in_pieces_is_the_content_of_the_whole(raw, cuts, crlf):
    data = b"\r\n" + raw
    points = pieces_of(data, cuts)
    for in_header, whole in (
        (True, content.header(raw, crlf, True)),
        (False, content.body(raw, True)),
    ):
        pieces = Pieces(_ROOMY, crlf)
        made = [pieces.take(data[a:b], data[a - 2 : a], in_header) for a, b in pairwise(points)]
        assert b"".join(made) == whole, (in_header, made)
        assert pieces.size == len(whole) and not pieces.refused


@settings(max_examples=300, deadline=None)
@given(
    raw=_DATA.filter(lambda raw: not content.has_bare_newline(raw)),
    cuts=st.lists(st.integers(0, 120)),
)
def test_reject_mode_pieces_are_unstuffed_like_the_whole(raw, cuts):
    data = b"\r\n" + raw
    points = pieces_of(data, cuts)
    pieces = Pieces(Limits(1 << 20, 1 << 20, 1 << 20, reject=True), True)
    made = [pieces.take(data[a:b], data[a - 2 : a], False) for a, b in pairwise(points)]
    assert b"".join(made) == data.replace(b"\r\n.", b"\r\n")[2:]


@settings(max_examples=500, deadline=None)
@given(raw=_DATA, window=st.integers(1, 50), seen=st.integers(0, 200))
@example(raw=b"abc\r\nrest", window=5, seen=6)  # the CRLF that counts ends the window
def test_the_line_ending_and_header_end_known_early_are_those_of_the_whole(raw, window, seen):
    # The data of a whole message ends with the CRLF before the final dot; a streamed one
    # is judged on what has come so far (the final dot not among it).
    whole = b"\r\n" + raw + b"\r\n"
    while b"\r\n.\r\n" in whole:  # the final dot must be the last
        whole = whole.replace(b"\r\n.\r\n", b"\r\n,\r\n")
    raw = whole[2:]
    crlf = content.uses_crlf(whole, window, complete=True)
    split = content.header_end(whole, crlf, window)
    part = (whole + b".\r\n")[:seen]
    if len(part) == len(whole) + 3:
        return  # the final dot is in: no longer streaming
    early = content.uses_crlf(part, window, complete=False)
    assert early in (None, crlf)
    if early is not None:
        found = content.header_end(part, early, window)
        assert found in (-1, split)
        if found < 0 and len(part) >= window + 5:  # known to be too long
            assert split < 0 and len(raw) > window


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.integers(0, 30), max_size=20),
    cuts=st.lists(st.integers(0, 400), max_size=10),
    limit=st.integers(1, 25),
)
def test_a_line_over_the_limit_is_found_across_pieces(lines, cuts, limit):
    text = b"".join(b"x" * n + b"\r\n" for n in lines)
    points = sorted({0, len(text)} | {c for c in cuts if 0 < c < len(text) and text[c - 1] != 13})
    tail = 0
    for a, b in pairwise(points):
        tail = content.line_tail(text[a:b], limit, tail) if tail >= 0 else tail
    assert (tail < 0) == content.has_line_over(text, limit) == (max(lines, default=0) > limit)
