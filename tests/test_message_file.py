from __future__ import annotations

import os
import struct
import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.model import Message, Recipient
from mtaqueue.spool.message_file import (
    MAGIC,
    CorruptMessageFile,
    prelude_and_header,
    read_content,
    read_message_file,
)

MESSAGE = Message(
    id="0123456789ABC000",
    sender="app@example.com",
    recipients=(Recipient("a@example.com", notify="FAILURE"), Recipient("b@example.org")),
    created=1_700_000_000.25,
    size=42,
    klass="p0",
    idempotency_key="reset-123",
)
CONTENT = b"Subject: hi\r\n\r\n.leading dot, unstuffed\r\n" + bytes(range(256))


def write(path: Path, message: Message = MESSAGE, content: bytes = CONTENT) -> bytes:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.writev(fd, [prelude_and_header(message, content), content])
    finally:
        os.close(fd)
    return path.read_bytes()


def test_round_trip(tmp_path):
    path = tmp_path / MESSAGE.id
    write(path)
    assert read_message_file(path) == (MESSAGE, CONTENT)
    assert read_content(path) == CONTENT


def test_empty_content(tmp_path):
    path = tmp_path / MESSAGE.id
    write(path, content=b"")
    assert read_message_file(path) == (MESSAGE, b"")


def _undecodable_header(data: bytes) -> bytes:
    header = b"\x93\x01\x02\x03"  # a msgpack array, but not a Message
    prelude = struct.pack("<4sIII", MAGIC, len(header), zlib.crc32(header), zlib.crc32(CONTENT))
    return prelude + header + CONTENT


def _flip(at: int):
    return lambda data: data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


CORRUPTIONS = {
    "empty file": (lambda data: b"", "short file"),
    "short prelude": (lambda data: data[:10], "short file"),
    "bad magic": (lambda data: b"MTQ2" + data[4:], "bad magic"),
    "header length past the end": (
        lambda data: data[:4] + struct.pack("<I", 1 << 31) + data[8:],
        "header length",
    ),
    "truncated header": (lambda data: data[:20], "header length"),
    "header byte flipped": (_flip(20), "header checksum"),
    "content truncated": (lambda data: data[:-1], "content checksum"),
    "content extended": (lambda data: data + b"\0", "content checksum"),
    "content byte flipped": (_flip(-5), "content checksum"),
    "undecodable header": (_undecodable_header, "undecodable header"),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_each_corruption_is_detected(tmp_path, kind):
    corrupt, reason = CORRUPTIONS[kind]
    path = tmp_path / MESSAGE.id
    path.write_bytes(corrupt(write(path)))
    with pytest.raises(CorruptMessageFile, match=reason) as info:
        read_message_file(path)
    assert info.value.path == path and isinstance(info.value, ValueError)
    if reason != "undecodable header":  # read_content does not decode the header
        with pytest.raises(CorruptMessageFile, match=reason):
            read_content(path)


@given(st.binary(max_size=300), st.data())
def test_any_flipped_byte_or_cut_is_detected(content, data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / MESSAGE.id
        good = write(path, content=content)
        if data.draw(st.booleans(), label="cut"):
            bad = good[: data.draw(st.integers(0, len(good) - 1), label="length")]
        else:
            at = data.draw(st.integers(0, len(good) - 1), label="at")
            bad = good[:at] + bytes([good[at] ^ data.draw(st.integers(1, 255))]) + good[at + 1 :]
        path.write_bytes(bad)
        with pytest.raises(CorruptMessageFile):
            read_message_file(path)
