"""A real HTTP endpoint on loopback for the daemon to call: the application's side of
revalidation (and of anything else mtaqueue POSTs signed JSON to).

An aiohttp server with its own event loop in a background thread, as the SMTP peers are.
Each request is recorded with its JSON body and whether its X-Mtaqueue-Signature verifies
with `secret`; a request that does not verify is answered 401. The answer is scripted per
message id (`answers`), else `default`: an HTTP status, or HANG (no answer until the
client gives up, or `hang_for` seconds pass).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mtaqueue.events import signing

HANG = "hang"


@dataclass(frozen=True)
class Request:
    time: float
    path: str
    body: dict[str, Any]
    signed: bool  # the signature verified with the endpoint's secret
    user_agent: str = ""


class HttpEndpoint:
    def __init__(self, secret: str = "", hang_for: float = 30.0) -> None:
        self.secret = secret
        self.hang_for = hang_for
        self.default: int | str = 200
        self.answers: dict[str, int | str] = {}  # message id -> status or HANG
        self.requests: list[Request] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/revalidate"

    def start(self) -> HttpEndpoint:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> HttpEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def about(self, message_id: str) -> list[Request]:
        return [r for r in self.requests if r.body.get("message_id") == message_id]

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/{path:.*}", self._handle)
        # A hanging answer must not hold the stop for long.
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        # Answers still hanging end here, not as tasks destroyed with the loop.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        header = request.headers.get(signing.HEADER, "")
        signed = bool(self.secret) and signing.verify(self.secret, raw, header, time.time())
        body = json.loads(raw)
        agent = request.headers.get("User-Agent", "")
        self.requests.append(Request(time.time(), request.path, body, signed, agent))
        if self.secret and not signed:
            return web.Response(status=401, text="bad signature")
        answer = self.answers.get(body.get("message_id", ""), self.default)
        if answer == HANG:
            await asyncio.sleep(self.hang_for)
            answer = 200
        return web.Response(status=int(answer), text="")
