"""A receiver that throttles silently, for the latency tests: it never refuses, it slows.

    with SlowPeer(comfort=2, per_session=0.3, base=0.002, steady=0.0) as peer:
        peer.port  peer.accepted  peer.rates  peer.max_sessions  peer.connections
    comfort       sessions it takes without slowing (None: any number)
    per_session   seconds added to the reply after the final dot per session over comfort
    comfort_rate  messages a second (over the last second) it takes without slowing
    per_rate      seconds added to that reply per time over comfort_rate
    after         messages it accepts before it slows at all (a site pushed long enough)
    base          seconds before that reply at any load (network and filters)
    steady        seconds before that reply always: a host slow at any load
    banner        the same slowing for the greeting as well
    elsewhere     its thread runs at a higher priority (nice -15, where we may raise it): a
                  receiver on another machine, which the load of ours does not slow

It offers PIPELINING and answers each command as it reads it (a pipelined group's replies
go out together). `accepted` holds, for each message, how many sessions were open when
its content was answered, `rates` the messages it accepted over the second before; the
delays never answer 4xx or 5xx.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time


class SlowPeer:
    def __init__(
        self,
        comfort: int | None = None,
        per_session: float = 0.0,
        base: float = 0.0,
        steady: float = 0.0,
        banner: bool = False,
        host: str = "127.0.0.2",
        comfort_rate: float | None = None,
        per_rate: float = 0.0,
        after: int = 0,
        elsewhere: bool = False,
    ) -> None:
        self.after = after
        self.elsewhere = elsewhere
        self.comfort, self.per_session = comfort, per_session
        self.comfort_rate, self.per_rate = comfort_rate, per_rate
        self.rates: list[float] = []  # at each acceptance, those of the second before
        self._times: collections.deque[float] = collections.deque()
        self.base, self.steady, self.banner = base, steady, banner
        self.host = host
        self.accepted: list[int] = []  # sessions open at each message's acceptance
        self.max_sessions = 0
        self.connections = 0
        self._open = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> SlowPeer:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = future.result(10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        # Not root: the load slows this receiver as it slows us. (Linux's priority is
        # per thread: this one only.)
        if self.elsewhere:
            with contextlib.suppress(PermissionError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -15)
        self._loop.run_forever()

    def delay(self) -> float:
        """The wait before a slowed reply, at the sessions open now."""
        if len(self.accepted) < self.after:
            return self.base
        over = 0 if self.comfort is None else max(0, self._open - self.comfort)
        delay = self.steady + self.base + self.per_session * over
        if self.comfort_rate is not None:
            delay += self.per_rate * max(0.0, self._rate() / self.comfort_rate - 1)
        return delay

    def _rate(self) -> float:
        """Messages accepted over the last second."""
        now = time.monotonic()
        while self._times and self._times[0] < now - 1.0:
            self._times.popleft()
        return float(len(self._times))

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._session, self.host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            task.cancel()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        self.connections += 1
        self.max_sessions = max(self.max_sessions, self._open)
        try:
            if self.banner:
                await asyncio.sleep(self.delay())
            writer.write(b"220 slow.test ESMTP\r\n")
            while line := await reader.readline():
                verb = line[:4].upper()
                if verb in (b"EHLO", b"HELO"):
                    writer.write(b"250-slow.test\r\n250-PIPELINING\r\n250 SIZE 10000000\r\n")
                elif verb == b"DATA":
                    writer.write(b"354 go ahead\r\n")
                    await writer.drain()
                    while (await reader.readline()) not in (b".\r\n", b""):
                        pass
                    await asyncio.sleep(self.delay())
                    self.accepted.append(self._open)
                    self._times.append(time.monotonic())
                    self.rates.append(self._rate())
                    writer.write(b"250 2.0.0 queued\r\n")
                elif verb == b"QUIT":
                    writer.write(b"221 bye\r\n")
                    break
                else:
                    writer.write(b"250 2.0.0 ok\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._open -= 1
            writer.close()
