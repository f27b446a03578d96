"""Length-prefixed frames on a stream socket: how the daemon talks to its child processes
(the spool writer, the DKIM signer)."""

from __future__ import annotations

import struct

_LENGTH = struct.Struct("<I")


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def split_frames(buffer: bytearray) -> list[bytes]:
    """Remove and return the complete frames at the start of `buffer`."""
    frames = []
    while len(buffer) >= 4:
        (length,) = _LENGTH.unpack_from(buffer)
        if len(buffer) < 4 + length:
            break
        frames.append(bytes(buffer[4 : 4 + length]))
        del buffer[: 4 + length]
    return frames
