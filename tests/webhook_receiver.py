"""A real HTTP webhook receiver for tests: aiohttp in a thread on 127.0.0.1.

It checks every request's X-Mtaqueue-Signature with the shared secret (a bad one is
answered 401 and counted in `bad_signatures`), keeps the events it accepted in order, and
can be told to fail (`status = 503`), to answer slowly (`delay`), or be stopped and
started again on the same port (an endpoint that goes down and comes back).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import web

from mtaqueue.events.signing import HEADER, verify


class WebhookReceiver:
    def __init__(self, secret: str = "s3cret", port: int = 0) -> None:
        self.secret = secret
        self.port = port
        self.status = 200  # what to answer a well-signed request
        self.delay = 0.0
        self.requests: list[list[dict]] = []  # the accepted bodies, in order
        self.raw: list[tuple[str, bytes]] = []  # (signature header, body) of each accepted
        self.bad_signatures = 0
        self.failed = 0  # requests answered with a non-2xx status on purpose
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return [e for body in self.requests for e in body]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if not verify(self.secret, body, request.headers.get(HEADER, ""), time.time()):
            self.bad_signatures += 1
            return web.Response(status=401)
        if self.delay:
            await asyncio.sleep(self.delay)
        if not 200 <= self.status < 300:
            self.failed += 1
            return web.Response(status=self.status)
        with self._lock:
            self.requests.append(json.loads(body))
            self.raw.append((request.headers[HEADER], body))
        return web.Response(status=204)

    def start(self) -> WebhookReceiver:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            app = web.Application()
            app.router.add_post("/hook", self._handle)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
            await site.start()
            self.port = self._runner.addresses[0][1]
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("webhook receiver did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        future.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> WebhookReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
