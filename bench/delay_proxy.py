"""A TCP proxy on loopback that delays each direction by a fixed time, as a real path does.

    with DelayProxy("127.0.0.1:2801", "127.0.0.1:2700", delay=0.025) as proxy:
        ...  # connect to 127.0.0.1:2801
        proxy.turns       client writes that came after the server had spoken: round trips
        proxy.dots        when each end of data ("CRLF.CRLF" from a client) arrived
        proxy.connections

Bytes are released in order, `delay` seconds after they arrived, each direction on its own
(neither waits for the other): a round trip costs 2 x delay, and a client that writes a
whole group at once pays it once. A "turn" is counted each time data from the client
arrives after data from the server: what a client that waits for replies pays a round
trip for. Runs its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Self

from postfix_tools import parse_loopback


class DelayProxy:
    def __init__(self, listen: str, target: str, delay: float) -> None:
        self.host, self.port = parse_loopback(listen)
        self.target = parse_loopback(target)
        self.delay = delay
        self.turns = 0
        self.dots: list[float] = []
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._session, self.host, self.port, backlog=200)
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _session(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter):
        self.connections += 1
        try:
            sreader, swriter = await asyncio.open_connection(*self.target)
        except OSError:
            cwriter.close()
            return
        last = {"side": "server"}  # the banner comes first
        try:
            await asyncio.gather(
                self._pump(creader, swriter, "client", last),
                self._pump(sreader, cwriter, "server", last),
                return_exceptions=True,
            )
        except asyncio.CancelledError:  # the proxy stops with sessions open
            cwriter.close()
            swriter.close()

    async def _pump(self, reader, writer, side: str, last: dict[str, str]) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                at, data = await queue.get()
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(release())
        try:
            while True:
                data = await reader.read(65536)
                if side == "client" and data and last["side"] == "server":
                    self.turns += 1
                if side == "client":  # (an end of data split across reads is not seen)
                    self.dots += [time.monotonic()] * data.count(b"\r\n.\r\n")
                if data:
                    last["side"] = side
                await queue.put((time.monotonic() + self.delay, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
