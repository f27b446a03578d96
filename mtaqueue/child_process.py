"""Starting a child process of the daemon that talks to it over a socketpair (the spool
writer, the DKIM signer): `python -m MODULE --fd N ...`, its end of the pair as fd N."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Sequence


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
