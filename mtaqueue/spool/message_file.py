"""One message on disk: a checksummed prelude, the record at acceptance, the content.

    prelude  <4sIII>  magic b"MTQ1", header length, crc32(header), crc32(content)
    header            msgpack of the `Message` as accepted
    content           the message as received: CRLF line endings, dot-unstuffed

The header lets recovery rebuild a message whose journal record was lost; the
journal, not the header, holds its current state.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import msgspec

from mtaqueue.model import Message

MAGIC = b"MTQ1"
_PRELUDE = struct.Struct("<4sIII")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class CorruptMessageFile(ValueError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def prelude_and_header(message: Message, content: bytes) -> bytes:
    """Everything before the content, so the writer can writev() without copying it."""
    header = _encoder.encode(message)
    return _PRELUDE.pack(MAGIC, len(header), zlib.crc32(header), zlib.crc32(content)) + header


def read_message_file(path: Path) -> tuple[Message, bytes]:
    header, content = _read(path)
    try:
        return _decoder.decode(header), content
    except msgspec.DecodeError as exc:
        raise CorruptMessageFile(path, f"undecodable header: {exc}") from None


def read_content(path: Path) -> bytes:
    return _read(path)[1]


def _read(path: Path) -> tuple[bytes, bytes]:
    """The header and content, checked against the prelude."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prelude = f.read(_PRELUDE.size)
        if len(prelude) < _PRELUDE.size:
            raise CorruptMessageFile(path, f"short file ({size} bytes)")
        magic, header_len, header_crc, content_crc = _PRELUDE.unpack(prelude)
        if magic != MAGIC:
            raise CorruptMessageFile(path, f"bad magic {magic!r}")
        # Checked before reading, so a corrupt length cannot make us allocate it.
        if header_len > size - _PRELUDE.size:
            raise CorruptMessageFile(path, f"header length {header_len} exceeds the file")
        header = f.read(header_len)
        content = f.read()
    if zlib.crc32(header) != header_crc:
        raise CorruptMessageFile(path, "header checksum mismatch")
    if zlib.crc32(content) != content_crc:
        raise CorruptMessageFile(path, "content checksum mismatch")
    return header, content
