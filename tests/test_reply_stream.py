"""The client's reply reader (smtp/reply_stream.py): replies cut anywhere across reads come
out whole and in order; what is no SMTP reply ends the stream with a protocol error after
the replies that came before it."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.smtp.reply_stream import MAX_LINE, ReplyStream, StreamError

text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
reply = st.tuples(st.integers(200, 599), st.lists(text, min_size=1, max_size=4))


def wire(code: int, lines: list[str]) -> bytes:
    out = [f"{code}-{line}" for line in lines[:-1]] + [f"{code} {lines[-1]}"]
    return "".join(f"{line}\r\n" for line in out).encode()


def read_all(chunks: list[bytes], count: int) -> list[tuple[int, str] | str]:
    async def go():
        stream = ReplyStream()
        for chunk in chunks:
            stream.data_received(chunk)
        got: list[tuple[int, str] | str] = []
        for _ in range(count):
            try:
                got.append(await stream.reply(0.5))
            except StreamError as exc:
                got.append(exc.event)
        return got

    return asyncio.run(go())


@given(st.lists(reply, min_size=1, max_size=6), st.lists(st.integers(0, 10_000), max_size=8))
def test_replies_cut_anywhere_come_out_whole_and_in_order(replies, cuts):
    data = b"".join(wire(code, lines) for code, lines in replies)
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    chunks = [data[a:b] for a, b in itertools.pairwise(points)]
    got = read_all(chunks, len(replies))
    expected = [(code, "\n".join(line.strip(" \t") for line in lines)) for code, lines in replies]
    assert got == expected


@pytest.mark.parametrize(
    "bad",
    [
        b"hello there\r\n",  # no code
        b"25 short\r\n",
        b"250x no separator\r\n",
        b"250-first\r\n550 last\r\n",  # a reply's lines differ in code
        b"2" * (MAX_LINE + 10),  # an endless line
    ],
)
def test_what_is_no_reply_is_a_protocol_error_after_the_good_ones(bad):
    got = read_all([b"250 ok\r\n" + bad], 3)
    assert got == [(250, "ok"), "protocol", "protocol"]


def test_a_reply_that_never_completes_times_out():
    assert read_all([b"250-more to come\r\n"], 1) == ["timeout"]
