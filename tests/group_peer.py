"""A strict PIPELINING server for client tests: it answers only where RFC 2920 lets a client
wait (after DATA, a BDAT chunk, the end of data, RSET, QUIT, EHLO, NOOP), so a client that
waits for each reply in turn stalls against it.

    GroupPeer(keywords=("PIPELINING",), answer=None, drop_ahead=False, delay=0.0)
    await .start() -> port / await .stop()
    .flushes      how many times it wrote replies (one round trip each, for the client)
    .sessions     each connection's own .flushes and .delivered (contents answered)
    .messages     {message tag: the reply it gave to that message's content}
    .commands     every command line it read, in order
    delay         seconds before each flush: a path's round trip, as the client sees it
    drop_ahead    a server broken for pipelining: it answers each command at once and
                  throws away what the client wrote behind it
    answer(verb, arg) -> str | None    a reply of the test's ("DOT" for the content, the
                  tag as arg); None keeps the default; "" sends nothing; "421 ..." closes

Each message's tag is the first word of its Subject header.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

_SUBJECT = re.compile(rb"^Subject: (\S+)", re.MULTILINE | re.IGNORECASE)
_WAITS = ("DATA", "BDAT", "DOT", "RSET", "QUIT", "EHLO", "HELO", "NOOP")


class GroupPeer:
    def __init__(
        self,
        keywords: tuple[str, ...] = ("PIPELINING",),
        answer: Callable[[str, str], str | None] | None = None,
        drop_ahead: bool = False,
        delay: float = 0.0,
    ) -> None:
        self.keywords = keywords
        self.drop_ahead = drop_ahead
        self.delay = delay
        self.answer = answer or (lambda verb, arg: None)
        self.flushes = 0
        self.messages: dict[str, str] = {}
        self.commands: list[str] = []
        self._server: asyncio.Server | None = None
        self._sessions: set[asyncio.Task] = set()
        self.sessions: list[_Session] = []  # each connection's .flushes and .delivered

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._session, "127.0.0.2", 0)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in self._sessions:  # sessions still open end here, not with the loop
            task.cancel()
        await asyncio.gather(*self._sessions, return_exceptions=True)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._sessions.add(task)
        task.add_done_callback(self._sessions.discard)
        session = _Session(self)
        self.sessions.append(session)
        try:
            await self._flush(writer, ["220 peer.test ESMTP"], session)
            while not session.over:
                data = await reader.read(65536)
                if not data:
                    return
                session.buffer += data
                replies, wait_point = session.process()
                if wait_point or session.over:
                    await self._flush(writer, replies, session)
                    session.replies = []
        except ConnectionError:
            return
        finally:
            writer.close()

    async def _flush(
        self, writer: asyncio.StreamWriter, replies: list[str], session: _Session
    ) -> None:
        data = "".join(f"{r}\r\n" for r in replies if r).encode()
        if not data:
            return
        if self.delay:
            await asyncio.sleep(self.delay)
        self.flushes += 1
        session.flushes += 1
        writer.write(data)
        await writer.drain()

    def reply(self, verb: str, arg: str) -> str:
        custom = self.answer(verb, arg)
        if custom is not None:
            return custom
        if verb == "EHLO":
            lines = ["peer.test", *self.keywords, "SIZE 10000000"]
            return "\r\n".join(f"250-{k}" for k in lines[:-1]) + f"\r\n250 {lines[-1]}"
        return {"DATA": "354 go ahead", "QUIT": "221 bye", "DOT": "250 2.0.0 queued"}.get(
            verb, "250 2.0.0 ok"
        )


class _Session:
    def __init__(self, peer: GroupPeer) -> None:
        self.peer = peer
        self.buffer = bytearray()
        self.replies: list[str] = []
        self.state = "command"  # or "data", or "bdat"
        self.chunk = 0
        self.flushes = 0  # of this session
        self.delivered = 0  # contents answered in this session
        self.over = False

    def process(self) -> tuple[list[str], bool]:
        """Every complete command or content in the buffer answered (withheld until a wait
        point); whether the last one was a wait point."""
        wait_point = False
        while not self.over:
            unit = self._next()
            if unit is None:
                break
            verb, arg = unit
            reply = self.peer.reply(verb, arg)
            if verb == "DOT":
                self.peer.messages[arg] = reply
                self.delivered += 1
            self.replies.append(reply)
            wait_point = verb in _WAITS or self.peer.drop_ahead
            if verb == "DATA" and reply.startswith("354"):
                self.state = "data"
            if verb == "QUIT" or reply.startswith("421"):
                self.over = True
            if self.peer.drop_ahead:
                self.buffer.clear()
                break
        return self.replies, wait_point

    def _next(self) -> tuple[str, str] | None:
        buf = self.buffer
        if self.state == "data":
            end = 0 if buf.startswith(b".\r\n") else buf.find(b"\r\n.\r\n")
            if end < 0:
                return None
            cut = end + 3 if end == 0 else end + 5
            content = bytes(buf[:cut])
            del buf[:cut]
            self.state = "command"
            return "DOT", _tag(content)
        if self.state == "bdat":
            if len(buf) < self.chunk:
                return None
            content = bytes(buf[: self.chunk])
            del buf[: self.chunk]
            self.state = "command"
            return "DOT", _tag(content)
        end = buf.find(b"\r\n")
        if end < 0:
            return None
        line = bytes(buf[:end]).decode("utf-8", "replace")
        del buf[: end + 2]
        self.peer.commands.append(line)
        verb, _, arg = line.partition(" ")
        verb = verb.upper()
        if verb == "BDAT":
            self.chunk, self.state = int(arg.split()[0]), "bdat"
            return self._next()
        return verb, arg


def _tag(content: bytes) -> str:
    found = _SUBJECT.search(content)
    return found[1].decode() if found else ""
