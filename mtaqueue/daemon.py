"""The `mtaqueue` daemon: wires config, spool, listener and control together.

    mtaqueue [-c FILE] [-o SECTION.KEY=VALUE ...]      # main(argv) -> exit status
    Daemon(cfg, reload, path): await run(), reload() (SIGHUP), info()

What the listener and the API take from the config is built in intake_settings.py; the
start-up sweep, the free-space watch and the watchdog's health in spool_upkeep.py.

Start order: recover the spool (queue state from the journal, read by the
daemon and by the spool writer it starts, side by side), bind the listener,
open the control socket, then check spool files in the background.
SIGTERM/SIGINT: stop accepting, let messages in transfer finish (bounded by
spool.shutdown_grace), commit the journal, exit 0 (1 if changes had to be
given up because the spool could not commit them in time).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path

import uvloop

from . import __version__, config, heap, memory_trace
from .alerts import Alerts
from .api.server import Api, ApiDeps
from .api.tokens import Tokens
from .control.commands import queue_commands
from .control.operations import operation_commands
from .control.server import ControlServer
from .control.suppression import suppression_commands
from .delivery.manager import DeliveryManager
from .dkim.keys import load_keys
from .dkim.service import SigningService
from .dkim.signer import Signer
from .events import derive
from .events.dispatch import Dispatcher
from .http_server import HttpServer
from .intake_settings import api_tokens, credentials, listener_settings, tls_context
from .listener_process import ListenerProcess
from .logs import configure_logging, get_logger
from .metrics import Metrics, Sources
from .metrics import serve as serve_metrics
from .routing.resolver import Resolver
from .sdnotify import Notifier
from .smtp.addresses import qualified_hostname
from .smtp.auth import hash_password
from .spool import event_log
from .spool.errors import SpoolLocked, StorageError
from .spool.store import Spool
from .spool_upkeep import SpoolUpkeep
from .submission import suppression_refusal

log = get_logger("daemon")

EXIT_CONFIG = 2
EXIT_RUNTIME = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtaqueue", description="Outbound mail queue daemon.")
    parser.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        help=f"TOML config file (default: $MTAQUEUE_CONFIG, else {config.SYSTEM_CONFIG} if it"
        " exists, else the built-in defaults, which conf/mtaqueue.toml lists)",
    )
    parser.add_argument(
        "-o",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set one config key over the file (repeatable); VALUE is read as TOML, else as"
        " a string, e.g. -o listen.address=127.0.0.1:2600 -o 'delivery.relayhost=[127.0.0.1]:2526'",
    )
    parser.add_argument(
        "--hash-password",
        action="store_true",
        help="read a password on stdin, print a hash for listen.auth_file, exit",
    )
    parser.add_argument("--version", action="version", version=f"mtaqueue {__version__}")
    args = parser.parse_args(argv)
    if args.hash_password:
        print(hash_password(sys.stdin.readline().rstrip("\n")))
        return 0
    path = args.config or config.default_path()
    try:
        cfg = config.load(path, args.overrides)
        daemon = Daemon(cfg, lambda: config.load(path, args.overrides), path, args.overrides)
    except config.ConfigError as exc:
        print(f"mtaqueue: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(cfg.log.level, cfg.log.format)
    memory_trace.install("daemon", Path(cfg.spool.path) / "tracemalloc")
    heap.one_arena()  # before the first thread
    return uvloop.run(daemon.run())


class Daemon:
    def __init__(
        self,
        cfg: config.Config,
        reload: Callable[[], config.Config],
        path: str | None = None,
        overrides: Sequence[str] = (),
    ) -> None:
        self.cfg = cfg
        self._load = reload  # reads the config again (SIGHUP)
        self.config_path = path  # None: the built-in defaults
        self.overrides = list(overrides)  # the listener's process reads the config as we did
        self.hostname = cfg.listen.hostname or socket.getfqdn()
        # Everything that can fail on bad settings is built here, before any I/O.
        self.listener_settings = listener_settings(cfg, self.hostname)
        self.listener: ListenerProcess | None = None  # started by run()
        # Checked here, before any I/O; the listener's process builds its own from the file.
        tls_context(cfg)
        credentials(cfg)
        self.api_tokens, self.api_token_warnings = api_tokens(cfg)
        # The key files are read here, and again at each SIGHUP (new keys then).
        self.signing = SigningService(Signer(load_keys(cfg.dkim)))
        self.spool = Spool(
            cfg.spool.path,
            min_free=cfg.spool.min_free.bytes_for,
            compact_size=cfg.spool.journal_compact_size,
            dedupe_window=cfg.submission.dedupe_window,
            file_after=cfg.spool.file_after,
        )
        self.spool.signing_keys = self.signing.pems  # the writer makes the signatures
        d = cfg.delivery
        self.resolver = Resolver(
            [config.parse_nameserver(n) for n in cfg.dns.nameservers],
            timeout=cfg.dns.timeout,
            negative_ttl_max=cfg.dns.negative_ttl_max,
            max_addresses=d.max_addresses,
            address_order=d.address_order,
        )
        self.delivery = DeliveryManager(cfg, self.spool, self.resolver, self.hostname)
        self.alerts = Alerts(cfg.alerts.rules)
        self.events = Dispatcher(
            event_log.EventLog(self.spool.layout.events), lambda: self.spool.last_event
        )
        self.spool.on_events = self.events.wake
        self.metrics = Metrics(
            Sources(
                queue=lambda: self.spool.messages,  # open() replaces it
                classes=lambda: self.cfg.classes,
                destinations=self.delivery.domains,
                dns=lambda: (self.resolver.cache.hits, self.resolver.cache.misses),
                free_bytes=lambda: self.spool.free_bytes,
                journal_bytes=self.spool.journal_bytes,
                alerts=self.alerts.active,
                webhooks=self.events.view,
                relay_of=self.delivery.relay_of,
                scheduled=self.delivery.scheduled,
                listener=lambda: self.listener.state() if self.listener is not None else {},
                processes=self._processes,
                memory=self._memory_sizes,
            ),
            top_n=cfg.metrics.top_destinations,
        )
        self.delivery.on_delivery = self.metrics.observe_delivery
        self.delivery.on_connect = self.metrics.observe_connect
        self.delivery.sign_notice = self.signing.sign_now
        self.started = time.time()
        self.upkeep = SpoolUpkeep(self.spool, self.started)
        self._stop = asyncio.Event()
        self.api: Api | None = None  # while the API is served

    def _suppressed(self, address: str) -> str | None:
        """The RCPT TO refusal for a suppressed address (the API's check; the listener's
        process checks its copy of the list)."""
        now = time.time()
        entry = self.spool.suppression(address, now)
        if entry is None:
            return None
        self._rcpt_refused(address, entry.reason, now)
        return suppression_refusal(address, entry.until, entry.reason)

    def _rcpt_refused(self, address: str, reason: str, now: float) -> None:
        """A suppressed address refused at RCPT (here, or in the listener's process)."""
        self.spool.emit([derive.suppressed(address, f"refused at RCPT: {reason}", now)])

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        try:
            report = await self.spool.open()
        except (SpoolLocked, OSError, StorageError) as exc:
            log.error("spool_open_failed", error=str(exc), path=self.cfg.spool.path)
            await self.spool.close(0)
            return EXIT_RUNTIME
        log.info(
            "spool_recovered",
            messages=report.messages,
            journal_records=report.journal_records,
            journal_segments=report.journal_segments,
            dropped_bytes=report.dropped_bytes,
            skipped_frames=report.skipped_frames,
            seconds=round(report.seconds, 3),
        )
        self.spool.last_event = event_log.last_seq(self.spool.layout.events)
        listener = ListenerProcess(
            self.spool, self.signing, self._rcpt_refused, self._listener_args()
        )
        commands = queue_commands(lambda: self.spool.messages, self.info, self.delivery.waiting_for)
        commands |= suppression_commands(self.spool, self.cfg.suppression.ttl)
        commands |= operation_commands(self.delivery, self.spool)
        commands["webhooks"] = self._webhooks
        control = ControlServer(
            config.control_socket_path(self.cfg), self.cfg.control.mode, commands
        )
        delivery = self.delivery
        if self.cfg.delivery.enabled:
            self.spool.on_commit = delivery.on_accepted
        metrics_server = api_server = None
        try:
            self._configure_events(self.cfg)
            await control.start()
            metrics_server = await self._serve_metrics()
            api_server = await self._serve_api()
            if self.cfg.delivery.enabled:
                delivery.start()
            else:
                log.warning("delivery_disabled")
            await listener.start()  # last: mail it takes is due at once
        except (OSError, RuntimeError, StorageError) as exc:
            log.error("startup_failed", error=str(exc))
            await listener.close(0)
            for server in (metrics_server, api_server):
                if server is not None:
                    await server.close()
            await self.spool.close(self.cfg.spool.shutdown_grace)
            return EXIT_RUNTIME
        self.listener = listener
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        if not qualified_hostname(self.hostname):
            log.warning("hostname_unqualified", key="listen.hostname", hostname=self.hostname)
        self._warn_if_reports_unsigned()
        log.info("ready", listen=listener.addresses, version=__version__, pid=os.getpid())
        notifier = Notifier()
        if notifier.watchdog_interval is not None:
            self.upkeep.stall_limit = 2 * notifier.watchdog_interval  # WatchdogSec
        notifier.send(
            "READY=1",
            f"STATUS=accepting on {', '.join(listener.addresses)};"
            f" {len(self.spool.messages)} messages queued",
            f"MAINPID={os.getpid()}",
        )
        watchdog = asyncio.create_task(notifier.watchdog(self.upkeep.healthy))
        sweep = asyncio.create_task(self.upkeep.sweep(report))
        free_space = asyncio.create_task(self.upkeep.watch())
        alerting = asyncio.create_task(self._evaluate_alerts())
        await self._stop.wait()

        grace = self.cfg.spool.shutdown_grace
        log.info("stopping", grace=grace)
        notifier.send("STOPPING=1", "STATUS=stopping: finishing messages in transfer")
        # One deadline for the whole stop, whatever state the spool is in: the
        # listener and delivery finish side by side, the spool commits what they
        # leave in the time that remains (at least a second).
        deadline = time.monotonic() + grace
        # The API's requests under way finish as the listener's sessions do.
        closing = [listener.close(grace), delivery.close(grace)]
        if api_server is not None:
            closing.append(api_server.close())
        await asyncio.gather(*closing)
        await self.events.close()
        sweep.cancel()
        free_space.cancel()
        watchdog.cancel()
        alerting.cancel()
        if metrics_server is not None:
            await metrics_server.close()
        await control.close()
        clean = await self.spool.close(max(deadline - time.monotonic(), 1.0))
        log.info("stopped", accepted=listener.accepted)
        return 0 if clean else EXIT_RUNTIME

    def reload(self) -> None:
        """SIGHUP: read the config again and apply what can change without a restart.

        An invalid file is refused (logged) and the running config stays in force.
        Pacing, classes, retry, reply rules, routes, limits and logging change at once;
        addresses, paths and delivery.enabled need a restart (logged)."""
        try:
            new = self._load()
            settings = listener_settings(new, self.hostname)
            tokens, token_warnings = api_tokens(new)
            signer = Signer(load_keys(new.dkim))
            self._configure_events(new)
            self.delivery.reconfigure(new)
        except (config.ConfigError, OSError) as exc:
            log.error("reload_failed", error=str(exc))
            return
        restart_only = {
            "listen.address": (self.cfg.listen.address, new.listen.address),
            "spool.path": (self.cfg.spool.path, new.spool.path),
            "control.socket": (self.cfg.control.socket, new.control.socket),
            "metrics.address": (self.cfg.metrics.address, new.metrics.address),
            "api.address": (self.cfg.api.address, new.api.address),
            "delivery.enabled": (self.cfg.delivery.enabled, new.delivery.enabled),
            "listen.tls_cert": (self.cfg.listen.tls_cert, new.listen.tls_cert),
            "listen.auth_file": (self.cfg.listen.auth_file, new.listen.auth_file),
        }
        for key, (old, value) in restart_only.items():
            if old != value:
                log.warning("reload_needs_restart", key=key)
        self.signing.reconfigure(signer)
        self.listener_settings = settings  # the API's, at its next request
        if self.api is not None and tokens is not None:
            self.api.tokens = tokens
            self._warn_about_tokens(tokens, token_warnings)
        self._log_alerts(self.alerts.reconfigure(new.alerts.rules))
        self.metrics.top_n = new.metrics.top_destinations
        self.cfg = new
        self._warn_if_reports_unsigned()
        configure_logging(new.log.level, new.log.format)
        if self.listener is not None:  # "reloaded" once the listener's process has it too
            self.listener.reload(lambda: log.info("reloaded"))
        else:
            log.info("reloaded")

    def _configure_events(self, cfg: config.Config) -> None:
        """Make events only while a webhook wants them (raises OSError: a secret_file)."""
        self.events.configure(cfg.webhooks)
        actions = {name: c.expire_action for name, c in cfg.classes.items()}
        self.spool.events = actions if cfg.webhooks else None

    async def _webhooks(self, args: dict) -> AsyncGenerator[dict, None]:
        for row in self.events.view():
            yield row

    async def _serve_metrics(self) -> HttpServer | None:
        if not self.cfg.metrics.address:
            return None
        host, port = config.split_host_port(self.cfg.metrics.address, min_port=0)
        server = await serve_metrics(self.metrics, host, port)
        log.info("metrics_listening", address=server.addresses)
        return server

    async def _serve_api(self) -> HttpServer | None:
        if not self.cfg.api.address or self.api_tokens is None:
            return None
        self.api = Api(
            ApiDeps(
                spool=self.spool,
                signing=self.signing,
                delivery=self.delivery,
                settings=lambda: self.listener_settings,
                rcpt_check=self._suppressed,
                suppression_ttl=lambda: self.cfg.suppression.ttl,
            ),
            self.api_tokens,
        )
        host, port = config.split_host_port(self.cfg.api.address, min_port=0)
        app = self.api.app()
        server = await HttpServer(app, grace=self.cfg.spool.shutdown_grace).start(host, port)
        log.info("api_listening", address=server.addresses, tokens=len(self.api_tokens))
        self._warn_about_tokens(self.api_tokens, self.api_token_warnings)
        return server

    def _warn_if_reports_unsigned(self) -> None:
        """TLS-RPT collectors ignore report mail without a valid DKIM signature (RFC 8460
        5.3): say so when no key signs tls_rpt.from's mail."""
        reports = self.delivery.tls_reports
        if not self.cfg.tls_rpt.enabled or reports is None:
            return
        fields = [(b"from", f"From: <{reports.sender}>\r\n".encode())]
        if not self.signing.signer.keys_for(fields):
            log.warning(
                "tls_rpt_unsigned",
                key="tls_rpt.from",
                sender=reports.sender,
                effect="no DKIM key signs the report mail: collectors ignore it",
            )

    @staticmethod
    def _warn_about_tokens(tokens: Tokens, warnings: list[str]) -> None:
        for warning in warnings:
            log.warning("api_tokens_file", key="api.tokens_file", warning=warning)
        if not len(tokens):
            log.warning("api_no_tokens", key="api.tokens_file", effect="every request is a 401")

    def _processes(self) -> dict[str, int]:
        pids = {"daemon": os.getpid()}
        if self.spool.writer_pid is not None:
            pids["writer"] = self.spool.writer_pid
        if self.listener is not None and self.listener.pid is not None:
            pids["listener"] = self.listener.pid
        return pids

    def _listener_args(self) -> list[str]:
        args = ["--hostname", self.hostname]
        if self.config_path is not None:
            args += ["--config", self.config_path]
        if self.spool.messages:
            args += ["--last-id", max(self.spool.messages)]
        for item in self.overrides:
            args += ["-o", item]
        return args

    def _memory_sizes(self) -> dict[str, int]:
        """Entries of the in-memory maps that could grow (mtaqueue_memory_entries)."""
        return {
            **self.spool.memory_sizes(),
            **self.delivery.memory_sizes(),
            "dns_cache": len(self.resolver.cache),
            "alert_histories": self.alerts.size(),
            "listener_sessions": self.listener.sessions if self.listener else 0,
        }

    async def _evaluate_alerts(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.alerts.interval)
            if not self.cfg.alerts.rules:
                self.metrics.forget_gone()
                continue
            await self.metrics.refresh()
            now = time.time()
            self._log_alerts(self.alerts.evaluate(now, self.metrics.snapshot(now)))

    @staticmethod
    def _log_alerts(events: list[dict]) -> None:
        for event in events:
            log.warning(event.pop("event"), **event)

    def info(self) -> dict:
        listener = getattr(self, "listener", None)
        return {
            "version": __version__,
            "pid": os.getpid(),
            "config": self.config_path or "built-in defaults",
            "uptime": round(time.time() - self.started, 1),
            "listen": listener.addresses if listener else [],
            "connections": listener.sessions if listener else 0,
            "spool_free_bytes": self.spool.free_bytes,
            "accepting": self.spool.storage_ok,
            "journal_bytes": self.spool.journal_bytes(),
        }


if __name__ == "__main__":
    sys.exit(main())
