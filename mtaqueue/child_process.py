"""Child processes of the daemon that talk to it over a socketpair (the spool writer, the
DKIM signer): `python -m MODULE --fd N ...`, its end of the pair as fd N, frames both
ways (`framing`). Its first frame is "ready", or "error:<why>" if it cannot serve."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Sequence

from .framing import split_frames


class ChildLink(asyncio.Protocol):
    """Our end of the socketpair to a child: `ready` resolves with its first frame, each
    later frame goes to `answered()`, and `lost()` is called when it is gone."""

    def __init__(self, what: str) -> None:
        self.what = what  # for messages: "spool writer", "signer"
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()

    def answered(self, payload: bytes) -> None:
        raise NotImplementedError

    def lost(self) -> None:
        raise NotImplementedError

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        for payload in split_frames(self._buffer):
            if self.ready.done():
                self.answered(payload)
            elif payload == b"ready":
                self.ready.set_result(None)
            else:
                why = payload.decode(errors="replace").removeprefix("error:")
                self.ready.set_exception(RuntimeError(f"{self.what}: {why}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"{self.what} exited while starting"))
        self.lost()


async def start_child(
    module: str, args: Sequence[str], protocol: asyncio.Protocol
) -> asyncio.subprocess.Process:
    """Start the child, our end of the pair connected to `protocol`."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            *args,
            "--fd",
            str(theirs.fileno()),
            pass_fds=(theirs.fileno(),),
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    try:
        await loop.create_connection(lambda: protocol, sock=ours)
    except BaseException:
        ours.close()
        await abandon(process, None)
        raise
    return process


async def abandon(
    process: asyncio.subprocess.Process, transport: asyncio.BaseTransport | None
) -> None:
    """A child that did not start as it should (not ready in time, or we are closing):
    never leave it behind."""
    if transport is not None:
        transport.close()
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await process.wait()
