"""The daemon's side of the control socket, run inside its asyncio loop.

Each connection is its own task, so a slow or silent client stalls only itself;
a reply is streamed with backpressure and yields to the loop every few lines so
that listing a large queue does not starve delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import AsyncGenerator, Callable
from typing import Any

from mtaqueue.control import protocol

log = logging.getLogger(__name__)

Command = Callable[[dict[str, Any]], AsyncGenerator[dict[str, Any], None]]

REQUEST_TIMEOUT = 10.0  # seconds a client may take to send its request line
_YIELD_EVERY = 128  # data lines written between two turns given to the event loop
_PEERCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
# Python does not export SO_PEERGROUPS; 59 is its value in Linux's asm-generic ABI.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_GROUP_WRITE = 0o020  # connecting to a Unix socket needs write permission on it


class CommandError(Exception):
    """Raised by a command; its message becomes the reply's error line."""


class ControlError(RuntimeError):
    """The control socket cannot be set up."""


class ControlServer:
    """Serve `commands` on a Unix socket at `path` with permissions `mode`.

    Only root, the daemon's own uid and, when `mode` grants group write, members of
    the socket's group are answered; others get an error line even if the file
    mode would let them connect.
    """

    def __init__(self, path: str, mode: int, commands: dict[str, Command]) -> None:
        self._path = path
        self._mode = mode
        self._commands = commands
        self._uid = os.geteuid()
        self._gid = -1  # the socket file's group, known once bound
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self._remove_stale_socket()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # The umask keeps group and other out until chmod; owner bits pass so that
            # a directory another thread creates meanwhile stays usable by the daemon.
            old_umask = os.umask(0o077 & ~self._mode)
            try:
                sock.bind(self._path)
            finally:
                os.umask(old_umask)
            os.chmod(self._path, self._mode)
            self._gid = os.stat(self._path).st_gid
            self._server = await asyncio.start_unix_server(
                self._serve, sock=sock, limit=protocol.MAX_REQUEST
            )
        except BaseException:
            # A file we bound is left as a stale socket for the next start to clear;
            # unlinking here could remove a path someone else bound first.
            sock.close()
            raise

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)

    async def _remove_stale_socket(self) -> None:
        try:
            st = os.lstat(self._path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlError(f"{self._path} exists and is not a socket")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(self._path), 5.0)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(self._path)  # left behind by a daemon that died
            return
        except (OSError, TimeoutError) as exc:
            raise ControlError(f"cannot check control socket {self._path}: {exc}") from None
        writer.close()
        raise ControlError(f"another daemon uses control socket {self._path}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._answer(reader, writer)
            await writer.drain()
        except ConnectionError:
            pass  # the client went away; nothing to tell it
        except Exception:  # a bug must cost one request a clear answer, not the reply
            log.exception("control request failed")
            writer.write(protocol.error_line("internal error handling the request"))
        finally:
            self._connections.discard(task)
            writer.close()

    def _refusal(self, sock: socket.socket) -> str | None:
        """Why the peer may not use the socket, or None if it may."""
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        _, uid, gid = _PEERCRED.unpack(raw)
        if uid in (0, self._uid):
            return None
        if self._mode & _GROUP_WRITE and (gid == self._gid or self._gid in _peer_groups(sock)):
            return None
        return f"permission denied: uid {uid} may not use the control socket"

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT)
        except ValueError:  # StreamReader's way of saying the line passed its limit
            writer.write(protocol.error_line(f"request longer than {protocol.MAX_REQUEST} bytes"))
            return
        except TimeoutError:
            writer.write(protocol.error_line("no request received in time"))
            return
        if not line:
            return  # connected and closed without asking anything
        # Checked after reading the request: closing a Unix socket with unread data
        # resets the connection, and the peer would lose the reason for the refusal.
        refusal = self._refusal(writer.get_extra_info("socket"))
        if refusal is not None:
            writer.write(protocol.error_line(refusal))
            return
        try:
            req = protocol.decode_request(line)
        except protocol.ProtocolError as exc:
            writer.write(protocol.error_line(str(exc)))
            return
        command = self._commands.get(req.cmd)
        if command is None:
            writer.write(protocol.error_line(f"unknown command {req.cmd!r}"))
            return
        try:
            async with contextlib.aclosing(command(req.args)) as items:
                sent = 0
                async for obj in items:
                    writer.write(protocol.encode(obj))
                    sent += 1
                    if sent % _YIELD_EVERY == 0:
                        await writer.drain()
                        await asyncio.sleep(0)  # drain does not yield unless the peer lags
        except CommandError as exc:
            writer.write(protocol.error_line(str(exc)))
        except ConnectionError:
            raise  # the client went away, which is no fault of the command
        except Exception as exc:
            log.exception("control command %r failed", req.cmd)
            writer.write(protocol.error_line(f"internal error in {req.cmd}: {exc}"))
        else:
            writer.write(protocol.OK_LINE)


def _peer_groups(sock: socket.socket) -> set[int]:
    """Supplementary groups the peer had when it connected.

    Python caps getsockopt buffers at 1024 bytes, room for 256 groups; a peer in
    more groups gets ERANGE and is judged by its primary group alone.
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
    except OSError:
        return set()
    return set(struct.unpack(f"{len(raw) // 4}I", raw))  # an array of 4-byte gid_t
