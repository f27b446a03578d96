from __future__ import annotations

import os
import struct
import tempfile
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.model import Message, Recipient
from mtaqueue.spool.message_file import (
    MAGIC,
    MAGIC_V1,
    MAGIC_V2,
    CorruptMessageFile,
    MessageFileWriter,
    file_parts,
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
        os.writev(fd, file_parts(message, content))
    finally:
        os.close(fd)
    return path.read_bytes()


def write_v1(path: Path, message: Message = MESSAGE, content: bytes = CONTENT) -> bytes:
    """The first format, as spools written before streaming hold it."""
    header = msgspec.msgpack.encode(message)
    prelude = struct.pack("<4sIII", MAGIC_V1, len(header), zlib.crc32(header), zlib.crc32(content))
    path.write_bytes(prelude + header + content)
    return path.read_bytes()


def write_v2(path: Path, message: Message = MESSAGE, content: bytes = CONTENT) -> bytes:
    """The second format (no head), as spools written before DKIM signing hold it."""
    header = msgspec.msgpack.encode(message)
    crcs = zlib.crc32(content), zlib.crc32(header)
    path.write_bytes(struct.pack("<4sQIII", MAGIC_V2, len(content), len(header), *crcs))
    with path.open("ab") as f:
        f.write(content + header)
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


@pytest.mark.parametrize("write_old", [write_v1, write_v2])
def test_files_of_the_older_formats_are_still_read(tmp_path, write_old):
    path = tmp_path / MESSAGE.id
    write_old(path)
    assert read_message_file(path) == (MESSAGE, CONTENT)
    assert read_content(path) == CONTENT
    if write_old is write_v1:  # its content is last, with no length of its own
        path.write_bytes(write_v1(path)[:-1])
        with pytest.raises(CorruptMessageFile, match="content checksum"):
            read_message_file(path)


def test_a_file_written_as_its_content_arrives_is_the_same_file(tmp_path):
    streamed = MessageFileWriter(tmp_path / "streamed.tmp")
    streamed.write(CONTENT[:10])
    streamed.write(CONTENT[10:100], CONTENT[100:])
    assert streamed.length == len(CONTENT)
    streamed.finish(MESSAGE)
    assert (tmp_path / "streamed.tmp").read_bytes() == write(tmp_path / MESSAGE.id)
    assert (tmp_path / "streamed.tmp").stat().st_mode & 0o777 == 0o600


def test_the_head_written_after_the_content_is_read_before_it(tmp_path):
    path = tmp_path / "signed.tmp"
    streamed = MessageFileWriter(path)
    streamed.write(CONTENT)
    head = b"DKIM-Signature: v=1; a=ed25519-sha256; b=...\r\n"
    streamed.finish(MESSAGE, head)
    assert read_message_file(path) == (MESSAGE, head + CONTENT)
    assert read_content(path) == head + CONTENT
    data = path.read_bytes()
    in_head = struct.calcsize("<4sQIIII") + len(CONTENT) + 5
    for bad in (data[:-1], _flip(in_head)(data)):
        path.write_bytes(bad)
        with pytest.raises(CorruptMessageFile):
            read_content(path)


def test_a_discarded_file_is_gone_and_takes_no_more_writes(tmp_path):
    path = tmp_path / "gone.tmp"
    streamed = MessageFileWriter(path)
    streamed.write(b"part of a message")
    streamed.discard()
    assert not path.exists()
    with pytest.raises(FileNotFoundError):
        streamed.write(b"more")
    assert not path.exists()
    streamed.discard()  # again: nothing to do


def _undecodable_header(data: bytes) -> bytes:
    header = b"\x93\x01\x02\x03"  # a msgpack array, but not a Message
    crcs = zlib.crc32(CONTENT), zlib.crc32(header)
    prelude = struct.pack("<4sQIIII", MAGIC, len(CONTENT), 0, len(header), *crcs)
    return prelude + CONTENT + header


def _flip(at: int):
    return lambda data: data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


CORRUPTIONS = {
    "empty file": (lambda data: b"", "short file"),
    "short prelude": (lambda data: data[:10], "short file"),
    "bad magic": (lambda data: b"MTQ4" + data[4:], "bad magic"),
    "content length past the end": (
        lambda data: data[:4] + struct.pack("<Q", 1 << 40) + data[12:],
        "do not add up",
    ),
    "truncated header": (lambda data: data[:-1], "do not add up"),
    "file extended": (lambda data: data + b"\0", "do not add up"),
    "header byte flipped": (_flip(-5), "header checksum"),
    "content byte flipped": (_flip(30), "content checksum"),
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
