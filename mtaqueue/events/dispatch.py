"""Sending the event log to the webhooks: at least once, in order, batched when slow.

    dispatcher = Dispatcher(event_log, last_event)  # an EventSource (spool.event_log.EventLog)
    dispatcher.configure(webhooks), wake(seq), view(), await close()

One task per endpoint reads the log after the endpoint's cursor, a batch at a time, and
POSTs the events it wants as a JSON array, signed. The cursor moves past a batch only once
the endpoint answered 2xx (then the events are its, for good: a receiver dedupes by `id`),
and is written to disk every few seconds and at stop, so a restart sends again at most
what was answered since. A failing endpoint is retried with backoff and jitter while the
rest of the daemon goes on: its backlog stays in the log on disk (only the batch being
tried is in memory), and its events older than `max_age` are dropped, logged as errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import msgspec

from .. import __version__
from ..config import WebhookConfig
from ..logs import get_logger
from .event import Event
from .signing import HEADER, read_secret, sign

log = get_logger("events")

RETRY_FIRST = 1.0  # seconds; doubled per failure up to RETRY_MAX, jittered
RETRY_MAX = 300.0
SAVE_EVERY = 2.0  # seconds between writes of the cursors
# After a batch smaller than batch_max, wait this long for more to join the next one: at a
# thousand events a second, a POST of ~50 events every 50 ms rather than one per few events.
LINGER = 0.05
_json = msgspec.json.Encoder()


class EventCursor(Protocol):
    """Reads the events after a seq, a batch at a time (spool.event_log.EventReader)."""

    after: int  # the seq of the last event read

    def read(self, limit: int) -> list[Event]: ...

    def close(self) -> None: ...


class EventSource(Protocol):
    """The event log as the dispatcher reads it (spool.event_log.EventLog): the spool owns
    its files, the daemon hands it over."""

    def reader(self, after: int) -> EventCursor: ...

    def read_cursors(self) -> dict[str, int]: ...

    def write_cursors(self, cursors: dict[str, int]) -> None: ...

    def remove_segments(self, acked: int, older_than: float) -> int: ...


@dataclass(slots=True)
class EndpointState:
    """What `mtaqueue-ctl webhooks` and the metrics show of an endpoint."""

    acked: int  # the seq of the last event the endpoint has (or did not want)
    sent: int = 0  # events answered 2xx since start
    dropped: int = 0  # events aged out since start
    failures: int = 0  # consecutive failed POSTs
    last_error: str = ""
    last_ok: float | None = None
    oldest_pending: float | None = None  # time of the oldest event not yet taken
    retry_at: float | None = None


@dataclass(slots=True)
class Endpoint:
    cfg: WebhookConfig
    secret: str
    state: EndpointState
    reader: EventCursor
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.cfg.name or self.cfg.url

    def wants(self, event: Event) -> bool:
        cfg = self.cfg
        return (
            (not cfg.events or event.type in cfg.events)
            and (not cfg.classes or event.klass in cfg.classes)
            and (not cfg.tenants or event.tenant in cfg.tenants)
        )


class Dispatcher:
    def __init__(self, event_log: EventSource, last_event: Callable[[], int]) -> None:
        self.event_log = event_log
        self._last_event = last_event  # the spool's newest seq
        self.endpoints: dict[str, Endpoint] = {}
        self._session: aiohttp.ClientSession | None = None
        self._saved: dict[str, int] = event_log.read_cursors()
        self._housekeeping: asyncio.Task | None = None

    def configure(self, webhooks: list[WebhookConfig]) -> None:
        """Start, change or stop endpoints (start and reload). Raises OSError for a
        secret_file that cannot be read. A new endpoint starts at the end of the log:
        it gets what happens from now on."""
        secrets = {(h.name or h.url): read_secret(h.secret, h.secret_file) for h in webhooks}
        if self._session is None and webhooks:
            self._session = aiohttp.ClientSession(headers={"User-Agent": f"mtaqueue/{__version__}"})
        for name in list(self.endpoints):
            if name not in secrets:
                self._stop(self.endpoints.pop(name))
        for hook in webhooks:
            name = hook.name or hook.url
            endpoint = self.endpoints.get(name)
            if endpoint is not None:
                endpoint.cfg, endpoint.secret = hook, secrets[name]
                continue
            acked = self._saved.get(name, self._last_event())
            endpoint = Endpoint(
                hook,
                secrets[name],
                EndpointState(acked),
                self.event_log.reader(acked),
            )
            self.endpoints[name] = endpoint
            endpoint.task = asyncio.create_task(self._run(endpoint), name=f"webhook {name}")
        self._save()  # at once: a new endpoint's start must not move to a later end
        if self._housekeeping is None:
            self._housekeeping = asyncio.create_task(self._keep())

    def wake(self, last_event: int) -> None:
        for endpoint in self.endpoints.values():
            endpoint.wake.set()

    async def close(self) -> None:
        for endpoint in self.endpoints.values():
            self._stop(endpoint)
        tasks = [e.task for e in self.endpoints.values() if e.task is not None]
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            tasks.append(self._housekeeping)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._save()
        if self._session is not None:
            await self._session.close()

    def view(self) -> list[dict]:
        now = time.time()
        last = self._last_event()
        rows = []
        for name, e in self.endpoints.items():
            s = e.state
            rows.append(
                {
                    "name": name,
                    "url": e.cfg.url,
                    "backlog": max(0, last - s.acked),
                    "oldest_age": None if s.oldest_pending is None else now - s.oldest_pending,
                    "sent": s.sent,
                    "dropped": s.dropped,
                    "failures": s.failures,
                    "last_error": s.last_error,
                    "last_ok": s.last_ok,
                    "retry_at": s.retry_at,
                }
            )
        return rows

    # -- one endpoint ---------------------------------------------------------------------

    async def _run(self, endpoint: Endpoint) -> None:
        while True:
            endpoint.wake.clear()
            caught_up = endpoint.reader.after >= self._last_event()
            batch = [] if caught_up else endpoint.reader.read(endpoint.cfg.batch_max)
            if not batch:
                endpoint.state.oldest_pending = None
                await endpoint.wake.wait()
                continue
            endpoint.state.oldest_pending = batch[0].time
            wanted = [e for e in batch if endpoint.wants(e)]
            while wanted:
                wanted = self._unexpired(endpoint, wanted)
                if not wanted or await self._post(endpoint, wanted):
                    break
                delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (endpoint.state.failures - 1))
                delay *= random.uniform(0.5, 1.5)
                endpoint.state.retry_at = time.time() + delay
                await asyncio.sleep(delay)
            endpoint.state.retry_at = None
            endpoint.state.acked = batch[-1].seq
            if len(batch) < endpoint.cfg.batch_max:
                await asyncio.sleep(LINGER)

    def _unexpired(self, endpoint: Endpoint, events: list[Event]) -> list[Event]:
        cutoff = time.time() - endpoint.cfg.max_age
        kept = [e for e in events if e.time >= cutoff]
        if len(kept) < len(events):
            gone = len(events) - len(kept)
            endpoint.state.dropped += gone
            log.error(
                "webhook_events_dropped",
                webhook=endpoint.name,
                events=gone,
                oldest=events[0].id,
                reason=f"not taken within max_age ({endpoint.cfg.max_age:g} s)",
            )
        return kept

    async def _post(self, endpoint: Endpoint, events: list[Event]) -> bool:
        body = _json.encode(events)
        headers = {
            "Content-Type": "application/json",
            HEADER: sign(endpoint.secret, body, time.time()),
        }
        state = endpoint.state
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=endpoint.cfg.timeout)
            async with self._session.post(
                endpoint.cfg.url, data=body, headers=headers, timeout=timeout
            ) as response:
                await response.read()
                ok = 200 <= response.status < 300
                problem = f"HTTP {response.status} {response.reason or ''}".strip()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, problem = False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if ok:
            if state.failures:
                log.info("webhook_recovered", webhook=endpoint.name, after=state.failures)
            state.failures, state.last_error, state.last_ok = 0, "", time.time()
            state.sent += len(events)
            return True
        state.failures += 1
        state.last_error = problem
        level = log.warning if state.failures < 5 else log.error
        level(
            "webhook_failed",
            webhook=endpoint.name,
            error=problem,
            events=len(events),
            failures=state.failures,
        )
        return False

    # -- the cursors and the log's old segments ------------------------------------------

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(SAVE_EVERY)
            self._save()
            with contextlib.suppress(OSError):
                self._trim()

    def _save(self) -> None:
        cursors = {name: e.state.acked for name, e in self.endpoints.items()}
        if cursors != self._saved:
            try:
                self.event_log.write_cursors(cursors)
            except OSError as exc:
                log.error("webhook_cursors_not_saved", error=str(exc))
                return
            self._saved = cursors

    def _trim(self) -> None:
        """Remove the segments every endpoint is past, or older than any keeps events."""
        if not self.endpoints:
            acked, longest = self._last_event(), 0.0
        else:
            acked = min(e.state.acked for e in self.endpoints.values())
            longest = max(e.cfg.max_age for e in self.endpoints.values())
        self.event_log.remove_segments(acked, time.time() - longest)

    def _stop(self, endpoint: Endpoint) -> None:
        if endpoint.task is not None:
            endpoint.task.cancel()
        endpoint.reader.close()
