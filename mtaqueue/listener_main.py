"""The listener's process: `python -m mtaqueue.listener_main --fd N --hostname H
[--config FILE] [-o KEY=VALUE ...] [--last-id ID]`, started by the daemon
(listener_process.py).

It reads the config as the daemon did, listens, says "ready" and `Bound` (the addresses),
and serves SMTP sessions, each message handed to the daemon's spool through the
`SpoolClient` on fd N. `Reload` reads the config again; `Drain` stops listening and lets
the sessions in the middle of a message finish; the daemon gone ends the process at once
(a client without its 250 sends again). Signals are the daemon's to act on: a SIGTERM to
the whole service must not cut sessions short before the daemon's drain.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import time
from pathlib import Path

import uvloop

from . import config, heap, memory_trace
from .dkim.keys import load_keys
from .dkim.service import SigningService
from .dkim.signer import Signer
from .framing import frame
from .intake_settings import credentials, listener_settings, tls_context
from .logs import configure_logging, get_logger
from .smtp.listener import Listener
from .smtp.spool_client import SpoolClient
from .spool.expiring import PRUNE_EVERY
from .submission import suppression_refusal

log = get_logger("listener")


class ListenerMain:
    def __init__(self, args: argparse.Namespace, cfg: config.Config) -> None:
        self.args = args
        self.drain: asyncio.Future = asyncio.get_running_loop().create_future()
        self.client = SpoolClient(self._drain, self._reload)
        self.signing = SigningService(Signer(load_keys(cfg.dkim)))
        self.listener = Listener(
            listener_settings(cfg, args.hostname),
            self.client,
            self.signing,
            tls=tls_context(cfg),
            credentials=credentials(cfg),
            rcpt_check=self._rcpt_check,
            on_change=self._changed,
        )
        self._told: tuple[int, ...] = ()

    async def run(self, sock: socket.socket) -> int:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(lambda: self.client, sock=sock)
        if self.args.last_id:
            self.client.ids.advance_past(self.args.last_id)
        try:
            await self.listener.start()
        except OSError as exc:
            transport.write(frame(f"error:{exc}".encode()))
            transport.close()
            return 1
        transport.write(frame(b"ready"))
        self.client.bound(self.listener.addresses)
        pruner = asyncio.create_task(self._prune())
        await asyncio.wait([self.drain, self.client.lost], return_when=asyncio.FIRST_COMPLETED)
        pruner.cancel()
        if self.client.lost.done():  # the daemon is gone: nothing can be accepted
            await self.listener.close(0)
            return 0
        await self.listener.close(self.drain.result())
        self._changed()
        transport.close()
        return 0

    def _drain(self, grace: float) -> None:
        if not self.drain.done():
            self.drain.set_result(grace)

    def _reload(self) -> None:
        try:
            self._read_config()
        finally:
            self.client.reloaded()

    def _read_config(self) -> None:
        try:
            new = config.load(self.args.config, self.args.overrides)
            settings = listener_settings(new, self.args.hostname)
            signer = Signer(load_keys(new.dkim))
        except (config.ConfigError, OSError) as exc:
            log.error("reload_failed", error=str(exc))  # the daemon read it; it changed since
            return
        self.signing.reconfigure(signer)
        self.listener.reconfigure(settings)
        configure_logging(new.log.level, new.log.format)

    def _rcpt_check(self, address: str) -> str | None:
        now = time.time()
        entry = self.client.suppression(address, now)
        if entry is None:
            return None
        self.client.rcpt_refused(address, entry.reason, now)
        return suppression_refusal(address, entry.until, entry.reason)

    def _changed(self) -> None:
        state = self.listener.state()
        told = (state["sessions"], state["stress"], state["shed"])
        if told != self._told:
            self._told = told
            self.client.state(*told)

    async def _prune(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_EVERY)
            if self.client.suppressed.forget_before(time.time()):
                heap.trim()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtaqueue-listener")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--hostname", required=True)
    parser.add_argument("--config")
    parser.add_argument("--last-id", default="")
    parser.add_argument("-o", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    heap.one_arena()  # as the daemon's other processes (docs/architecture.md, memory)
    sock = socket.socket(fileno=args.fd)
    cfg = config.load(args.config, args.overrides)  # the daemon read it a moment ago
    configure_logging(cfg.log.level, cfg.log.format)
    memory_trace.install("listener", Path(cfg.spool.path) / "tracemalloc")

    async def run() -> int:
        return await ListenerMain(args, cfg).run(sock)

    return uvloop.run(run())


if __name__ == "__main__":
    sys.exit(main())
