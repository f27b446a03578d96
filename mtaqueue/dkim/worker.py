"""The DKIM signer: `python -m mtaqueue.dkim.worker --fd N`, a child of the daemon.

An RSA-2048 signature costs ~0.26 ms of CPU (OpenSSL), more than the rest of accepting a
message; made in the event loop it would hold up every session, and a thread would not
help: it must win the GIL back from the busy loop after each signature. So the daemon
sends the messages to sign here, and this process signs them on another core.

The first frame holds the `[dkim]` tables, whose key files this process reads; it
answers "ready" or "error:<why>". Each later frame is one message, [content, time],
answered in order with [fields, converted content or b"", error or ""]. One thread: on
two cores, a thread pool cost a quarter more CPU a message for no more throughput (see
bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys

import msgspec

from ..config import ConfigError, DkimKeyConfig
from ..framing import frame, split_frames
from .keys import load_keys
from .signer import Signer

ANSWERS_PER_WRITE = 4  # ~1 ms of RSA signatures
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


def _first_frame(sock: socket.socket) -> bytes:
    buffer = bytearray()
    while not (frames := split_frames(buffer)):
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the daemon went away")
        buffer += data
    return frames[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtaqueue-dkim-signer")
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    # The daemon ends us by closing the socket (as it does its spool writer).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    try:
        tables = msgspec.msgpack.decode(_first_frame(sock), type=Tables)
        try:
            signer = Signer(load_keys(tables))
        except ConfigError as exc:
            sock.sendall(frame(f"error:{exc}".encode()))
            return 1
        sock.sendall(frame(b"ready"))
        serve(sock, signer)
    except ConnectionError:
        pass  # the daemon went away
    return 0


def serve(sock: socket.socket, signer: Signer) -> None:
    """Sign what comes, in order. The answers to what one read brought go out together, a
    few at a time: a syscall costs tens of microseconds here, but the first message of a
    burst must not wait for the last."""
    decoder = msgspec.msgpack.Decoder(Work)
    encoder = msgspec.msgpack.Encoder()
    buffer = bytearray()
    while data := sock.recv(1 << 20):
        buffer += data
        out: list[bytes] = []
        for payload in split_frames(buffer):
            out.append(frame(encoder.encode(sign_one(signer, decoder.decode(payload)))))
            if len(out) == ANSWERS_PER_WRITE:
                sock.sendall(b"".join(out))
                out = []
        if out:
            sock.sendall(b"".join(out))


if __name__ == "__main__":
    sys.exit(main())
