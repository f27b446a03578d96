"""An aiohttp application served on one address: the metrics endpoint and the HTTP API.

On the daemon's event loop (not a thread), because both read the loop's state.
"""

from __future__ import annotations

from aiohttp import web


class HttpServer:
    def __init__(self, app: web.Application, *, grace: float = 1.0) -> None:
        # aiohttp's access log is off: the API logs its own events, a scrape is not news.
        # `grace`: how long close() lets requests under way finish.
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=grace
        )

    async def start(self, host: str, port: int) -> HttpServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        return self

    @property
    def addresses(self) -> list[str]:
        return [f"{a[0]}:{a[1]}" for a in self._runner.addresses]

    async def close(self) -> None:
        """Stop listening, let requests under way finish (up to the grace), close the rest."""
        await self._runner.cleanup()
