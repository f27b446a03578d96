"""The DKIM signer: `python -m mtaqueue.dkim.worker --fd N`, a child of the daemon.

Signing costs more CPU than accepting a message (RSA-2048 alone ~0.3 ms here), and a
thread would not help: it must win the GIL back from a busy event loop after each
signature. So the daemon sends the content of each message to sign here, a batch at a
time, and this process, on the other core, answers with the signature fields.

The first frame holds the `[dkim]` tables, whose key files this process reads; it
answers "ready" or "error:<why>". Each later frame is one message, [content, time]; each
is answered as soon as it is signed (a batch answered at its end would keep the first
message of the batch waiting for the last), with [fields, converted content or b"",
error or ""].
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from collections.abc import Iterator

import msgspec

from ..config import ConfigError, DkimKeyConfig
from ..framing import frame, split_frames
from .keys import load_keys
from .signer import Signer

Tables = dict[str, list[DkimKeyConfig]]
Work = tuple[bytes, float]
Answer = tuple[bytes, bytes, str]


def sign_one(signer: Signer, work: Work) -> Answer:
    content, now = work
    try:
        signed = signer.sign(content, now)
    except Exception as exc:  # a bug fails its message, not the others
        return b"", b"", f"signing failed: {exc!r}"
    if signed is None:  # the daemon asked only for mail that a key signs
        return b"", b"", ""
    fields, stored = signed
    return fields, b"" if stored is content else stored, ""


def _frames(sock: socket.socket) -> Iterator[bytes]:
    buffer = bytearray()
    while data := sock.recv(1 << 20):
        buffer += data
        yield from split_frames(buffer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtaqueue-dkim-signer")
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    # The daemon ends us by closing the socket (as it does its spool writer).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    frames = _frames(sock)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(Work)
    try:
        tables = msgspec.msgpack.decode(next(frames), type=Tables)
        try:
            signer = Signer(load_keys(tables))
        except ConfigError as exc:
            sock.sendall(frame(f"error:{exc}".encode()))
            return 1
        sock.sendall(frame(b"ready"))
        for payload in frames:
            sock.sendall(frame(encoder.encode(sign_one(signer, decoder.decode(payload)))))
    except (ConnectionError, StopIteration):
        pass  # the daemon went away
    return 0


if __name__ == "__main__":
    sys.exit(main())
