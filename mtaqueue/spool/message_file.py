"""One message on disk: a checksummed prelude, the content, the record at acceptance.

    prelude  <4sQIIII> magic b"MTQ3", content length, head length, header length,
                       crc32(content and head, as they lie in the file), crc32(header)
    content            the message as received: CRLF line endings, dot-unstuffed
    head               header fields that go before the content: the DKIM signature of
                       a message written as it arrived (b"" for any other)
    header             msgpack of the `Message` as accepted

The message is the head followed by the content. The content comes first so that a
message too large to hold can be written as it arrives (`MessageFileWriter`): what is
only known once it is complete (its signature, its record, which holds its size, and
the prelude) follows. Files of the older formats are still read:

    prelude  <4sQIII>  magic b"MTQ2", content length, header length,
                       crc32(content), crc32(header)
    content, header
    prelude  <4sIII>   magic b"MTQ1", header length, crc32(header), crc32(content)
    header, content

The header lets recovery rebuild a message whose journal record was lost; the
journal, not the header, holds its current state.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import threading
import zlib
from pathlib import Path

import msgspec

from mtaqueue.model import Message

from .durable import write_all

MAGIC = b"MTQ3"
MAGIC_V2 = b"MTQ2"
MAGIC_V1 = b"MTQ1"
_PRELUDE = struct.Struct("<4sQIIII")
_PRELUDE_V2 = struct.Struct("<4sQIII")
_PRELUDE_V1 = struct.Struct("<4sIII")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class CorruptMessageFile(ValueError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def file_parts(message: Message, content: bytes) -> tuple[bytes, bytes, bytes]:
    """The prelude, content and header of a message file, for one writev() (no copy)."""
    return encoded_file_parts(_encoder.encode(message), content)


def encoded_file_parts(header: bytes, content: bytes) -> tuple[bytes, bytes, bytes]:
    """As file_parts, of a record already encoded."""
    return _prelude(len(content), 0, zlib.crc32(content), header), content, header


def _prelude(content_length: int, head_length: int, crc: int, header: bytes) -> bytes:
    return _PRELUDE.pack(MAGIC, content_length, head_length, len(header), crc, zlib.crc32(header))


class MessageFileWriter:
    """A message file whose content arrives in pieces. Blocking calls, for a worker
    thread, one at a time (but `discard()`, which may come from another): a placeholder
    prelude and the content as it comes, then the header record and, in place, the real
    prelude. The file (a temp file, which the spool writer renames) is whole only once
    `finish()` has returned."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.length = 0  # octets of content written
        self._crc = 0
        self._fd = -1
        self._discarded = False
        self._lock = threading.Lock()

    def write(self, *parts: bytes) -> None:
        with self._lock:
            fd = self._open()
            write_all(fd, *parts)
            for part in parts:
                self._crc = zlib.crc32(part, self._crc)
                self.length += len(part)

    def finish(self, message: Message, head: bytes = b"") -> None:
        """Write the fields that go before the content (`head`), the record (`message`,
        its size that of the head and content) and the prelude, flush the file to disk
        and close it."""
        header = _encoder.encode(message)
        with self._lock:
            fd = self._open()
            write_all(fd, head, header)
            crc = zlib.crc32(head, self._crc)
            prelude = _prelude(self.length, len(head), crc, header)
            if os.pwrite(fd, prelude, 0) != len(prelude):
                raise OSError(f"short write of the prelude of {self.path}")
            # Flushed here, in the daemon's thread: the spool writer's own fsync (before
            # its rename) then finds nothing to write, and its round is not held up.
            os.fsync(fd)
            self._fd = -1
            os.close(fd)

    def discard(self) -> None:
        """Close and remove the file, wherever it got to."""
        with self._lock:
            self._discarded = True
            if self._fd >= 0:
                fd, self._fd = self._fd, -1
                os.close(fd)
            with contextlib.suppress(OSError):  # a temp file: the start-up sweep removes it
                self.path.unlink(missing_ok=True)

    def _open(self) -> int:
        if self._discarded:
            raise FileNotFoundError(f"{self.path} was discarded")
        if self._fd < 0:
            self._fd = os.open(
                self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
            )
            try:
                write_all(self._fd, bytes(_PRELUDE.size))
            except OSError:
                os.close(self._fd)
                self._fd = -1
                raise
        return self._fd


def read_message_file(path: Path) -> tuple[Message, bytes]:
    header, content = _read(path)
    try:
        return _decoder.decode(header), content
    except msgspec.DecodeError as exc:
        raise CorruptMessageFile(path, f"undecodable header: {exc}") from None


def read_content(path: Path) -> bytes:
    return _read(path)[1]


def _read(path: Path) -> tuple[bytes, bytes]:
    """The header and the message (head and content), checked against the prelude."""
    # The file whole in one read (a buffered file would also ask the kernel whether it
    # is a terminal, and where it stands): the delivery path reads one per message.
    with open(path, "rb", buffering=0) as raw:
        data = raw.read(os.fstat(raw.fileno()).st_size)
    size = len(data)
    with io.BytesIO(data) as f:
        magic = f.read(4)
        if magic == MAGIC_V1:
            return _read_v1(path, f, size)
        if len(magic) == 4 and magic not in (MAGIC, MAGIC_V2):
            raise CorruptMessageFile(path, f"bad magic {magic!r}")
        layout = _PRELUDE if magic == MAGIC else _PRELUDE_V2
        prelude = magic + f.read(layout.size - 4)
        if len(prelude) < layout.size:
            raise CorruptMessageFile(path, f"short file ({size} bytes)")
        if magic == MAGIC:
            _, content_len, head_len, header_len, crc, header_crc = layout.unpack(prelude)
        else:
            _, content_len, header_len, crc, header_crc = layout.unpack(prelude)
            head_len = 0
        # Checked before reading, so a corrupt length cannot make us allocate it.
        if layout.size + content_len + head_len + header_len != size:
            lengths = f"{content_len} + {head_len} + {header_len}"
            raise CorruptMessageFile(path, f"lengths {lengths} do not add up to the file's {size}")
        content = f.read(content_len)
        head = f.read(head_len)
        header = f.read(header_len)
    _check(path, header, header_crc, content, crc, head)
    return header, head + content if head else content


def _read_v1(path: Path, f, size: int) -> tuple[bytes, bytes]:
    prelude = MAGIC_V1 + f.read(_PRELUDE_V1.size - 4)
    if len(prelude) < _PRELUDE_V1.size:
        raise CorruptMessageFile(path, f"short file ({size} bytes)")
    _, header_len, header_crc, content_crc = _PRELUDE_V1.unpack(prelude)
    if header_len > size - _PRELUDE_V1.size:
        raise CorruptMessageFile(path, f"header length {header_len} exceeds the file")
    header = f.read(header_len)
    content = f.read()
    _check(path, header, header_crc, content, content_crc)
    return header, content


def _check(
    path: Path, header: bytes, header_crc: int, content: bytes, crc: int, head: bytes = b""
) -> None:
    if zlib.crc32(header) != header_crc:
        raise CorruptMessageFile(path, "header checksum mismatch")
    if zlib.crc32(head, zlib.crc32(content)) != crc:
        raise CorruptMessageFile(path, "content checksum mismatch")
