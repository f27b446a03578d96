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
import os
import queue
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from ..config import ConfigError, DkimKeyConfig
from ..framing import frame, split_frames
from .keys import load_keys
from .signer import Signer

THREADS = min(4, os.cpu_count() or 1)
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
    try:
        tables = msgspec.msgpack.decode(next(frames), type=Tables)
        try:
            signer = Signer(load_keys(tables))
        except ConfigError as exc:
            sock.sendall(frame(f"error:{exc}".encode()))
            return 1
        sock.sendall(frame(b"ready"))
        serve(sock, frames, signer)
    except (ConnectionError, StopIteration):
        pass  # the daemon went away
    return 0


def serve(sock: socket.socket, frames: Iterator[bytes], signer: Signer) -> None:
    """Sign in THREADS threads (OpenSSL releases the GIL while it signs, and nothing else
    runs here: a burst of messages is signed on every core), answer in the order asked."""
    decoder = msgspec.msgpack.Decoder(Work)
    answers: queue.SimpleQueue[Future[Answer] | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_answers, args=(sock, answers), daemon=True)
    sender.start()
    with ThreadPoolExecutor(THREADS) as pool:
        for payload in frames:
            answers.put(pool.submit(sign_one, signer, decoder.decode(payload)))
    answers.put(None)
    sender.join()


def _send_answers(sock: socket.socket, answers: queue.SimpleQueue) -> None:
    """Send each answer once signed, with those after it that are signed too: one write
    for a burst, not one per message (a syscall here costs tens of microseconds)."""
    encoder = msgspec.msgpack.Encoder()
    head = answers.get()
    while head is not None:
        out = [frame(encoder.encode(head.result()))]
        while True:
            try:
                head = answers.get_nowait()
            except queue.Empty:
                head = _WAIT
                break
            if head is None or not head.done():
                break
            out.append(frame(encoder.encode(head.result())))
        try:
            sock.sendall(b"".join(out))
        except OSError:
            return  # the daemon went away
        if head is _WAIT:
            head = answers.get()


_WAIT = Future()  # nothing more was asked for yet


if __name__ == "__main__":
    sys.exit(main())
