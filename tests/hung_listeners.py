"""TCP listeners that accept and never say a word: SMTP servers that hang before the banner.

    HungListeners(addresses, port).start() / .stop()   one asyncio loop in a thread
    .accepts[address]       connections accepted, in all
    .most_open[address]     the most open at once
    .open_now()             connections open now, over all listeners
    hung_addresses(count)   loopback addresses for them (127.1.x.y), none of 127.0.0.x

Each connection is held until the client closes it (its banner timeout, or a stop).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter


def hung_addresses(count: int) -> list[str]:
    return [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(count)]


class HungListeners:
    def __init__(self, addresses: list[str], port: int) -> None:
        self.addresses, self.port = addresses, port
        self.accepts: Counter[str] = Counter()
        self.most_open: Counter[str] = Counter()
        self._open: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._servers: list[asyncio.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> HungListeners:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(30)
        return self

    async def _listen(self) -> None:
        for address in self.addresses:

            async def hold(reader, writer, address=address) -> None:
                self.accepts[address] += 1
                self._open[address] += 1
                self.most_open[address] = max(self.most_open[address], self._open[address])
                self._writers.add(writer)
                try:
                    while await reader.read(4096):  # whatever it says goes unanswered
                        pass
                except OSError:
                    pass
                finally:
                    self._open[address] -= 1
                    self._writers.discard(writer)
                    writer.close()

            self._servers.append(await asyncio.start_server(hold, address, self.port))

    def open_now(self) -> int:
        return sum(self._open.values())

    def stop(self) -> None:
        async def close() -> None:
            for server in self._servers:
                server.close()
            for writer in list(self._writers):
                writer.close()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self) -> HungListeners:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
