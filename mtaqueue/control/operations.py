"""Control commands that steer delivery: hold, release, flush, domains, limit, backoff,
forget, hosts, unsuspend, warmup, tls-report."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec

from mtaqueue.config import parse_duration, parse_rate
from mtaqueue.control import views
from mtaqueue.control.server import Command, CommandError
from mtaqueue.delivery.manager import DeliveryManager
from mtaqueue.model import Message
from mtaqueue.spool.store import Spool
from mtaqueue.spool.walk import chunks


def operation_commands(manager: DeliveryManager, spool: Spool) -> dict[str, Command]:

    def selection(args: dict[str, Any]) -> views.Filters:
        selector = {k: v for k, v in args.items() if k != "all" and v not in (None, [], "")}
        if not selector and not args.get("all"):
            raise CommandError(
                "name messages: queue ids, --domain, --class, --tenant, --state,"
                " --older-than, --review or --all"
            )
        if "older_than" in selector:
            try:
                selector["older_than"] = parse_duration(str(selector["older_than"]))
            except ValueError as exc:
                raise CommandError(f"bad --older-than: {exc}") from None
            selector["now"] = time.time()
        try:
            return msgspec.convert(selector, views.Filters)
        except msgspec.ValidationError as exc:
            raise CommandError(f"bad selection: {exc}") from None

    async def by_class(ids: list[str]) -> list[str]:
        """`ids` in class order (the first class first), queue order within a class: a
        flush of a million makes the password resets due in its first chunks, not
        wherever in its ten seconds the walk comes to them. Record heads only, a chunk
        at a time between looks at the loop."""
        queue = spool.messages
        rank = manager.placement.class_rank
        ranks: list[list[str]] = [[] for _ in range(len(rank) + 1)]  # the last: unknown
        for chunk in chunks(ids):
            for message_id in chunk:
                head = queue.head(message_id)
                ranks[rank.get(head.klass, -1) if head is not None else -1].append(message_id)
            await asyncio.sleep(0)
        return [message_id for same in ranks for message_id in same]

    async def matching(filters: views.Filters) -> AsyncIterator[list[Message]]:
        """The matches a chunk of the queue at a time, decoded and acted on before the
        loop runs again (so none is stale: a record changed meanwhile would be written
        back old), and only a chunk of them decoded at once: at a million queued,
        `flush --all` after an outage must not hold them all, nor stall the loop."""
        named = filters.ids is not None  # queue ids named: only those are looked at
        queue = spool.messages  # the recovered queue (the recovery replaces the map)
        ids = await by_class(list(dict.fromkeys(filters.ids)) if named else list(queue))
        for chunk in chunks(ids):
            found = (queue.get(i) for i in chunk)
            yield [m for m in found if m is not None and views.matches(m, filters)]
            await spool.drained()  # the records it changed, journaled before the next
            await asyncio.sleep(0)

    def bulk(action: Callable[[list[Message]], int], verb: str) -> Command:
        async def command(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
            count = 0
            async for batch in matching(selection(args)):
                count += action(batch) if batch else 0
            yield {verb: count}

        return command

    def lifting(action: Callable[[list[Message], set[str]], int], verb: str) -> Command:
        """A bulk command that lifts destinations (flush, requeue): once each per command,
        whatever the number of chunks its selection comes in."""

        def make(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
            lifted: set[str] = set()
            return bulk(lambda batch: action(batch, lifted), verb)(args)

        return make

    async def domains(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        for entry in await manager.view():
            yield entry

    async def limit(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        name = _name(args)
        rate = _per_minute(args.get("rate"))
        concurrency = args.get("concurrency")
        if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
            raise CommandError("--concurrency takes a whole number of at least 1")
        if rate is None and concurrency is None:
            raise CommandError("give --rate and/or --concurrency")
        until = _until(args.get("for"))
        yield {"destinations": manager.limit(name, rate, concurrency, until), "until": until}

    async def backoff(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        until = _until(args.get("for") or "15m")
        yield {"destinations": manager.backoff(_name(args), until), "until": until}

    async def forget(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        yield {"destinations": manager.forget_learned(_name(args))}

    async def hosts(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        for entry in manager.suspended_hosts():
            yield entry

    async def unsuspend(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        host, domain = args.get("host"), args.get("domain")
        named = [isinstance(name, str) and bool(name) for name in (host, domain)]
        if named.count(True) != 1:
            raise CommandError("name a HOST or a --domain (one of them)")
        yield manager.unsuspend(host=host or None, domain=domain or None)

    async def warmup_show(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        source = args.get("source")
        if source is not None and not isinstance(source, str):
            raise CommandError("a source is an address")
        try:
            entries = manager.warmups(source or None)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        for entry in entries:
            yield entry

    def warmup_move(to_first: bool) -> Command:
        async def command(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
            source, destination = args.get("source"), args.get("destination")
            if not isinstance(source, str) or not source:
                raise CommandError("name the source address")
            if destination is not None and not isinstance(destination, str):
                raise CommandError("--destination takes a destination or a domain")
            try:
                entries = await manager.move_warmup(source, destination or None, to_first)
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            for entry in entries:
                yield entry

        return command

    async def tls_report_send(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        reports = manager.tls_reports
        if reports is None or not reports.enabled:
            raise CommandError("TLS-RPT is off (tls_rpt.enabled = false)")
        for result in await reports.send_due(time.time(), today=bool(args.get("today"))):
            yield result

    return {
        "hold": bulk(manager.hold, "held"),
        "release": bulk(manager.release, "released"),
        "flush": lifting(manager.flush, "flushed"),
        "requeue": lifting(manager.requeue, "requeued"),
        "delete": bulk(manager.delete, "deleted"),
        "bounce": bulk(manager.bounce, "bounced"),
        "domains": domains,
        "limit": limit,
        "backoff": backoff,
        "forget": forget,
        "hosts": hosts,
        "unsuspend": unsuspend,
        "warmup_show": warmup_show,
        "warmup_restart": warmup_move(to_first=True),
        "warmup_finish": warmup_move(to_first=False),
        "tls_report_send": tls_report_send,
    }


def _name(args: dict[str, Any]) -> str:
    name = args.get("domain")
    if not isinstance(name, str) or not name:
        raise CommandError("--domain is required")
    return name


def _per_minute(text: Any) -> float | None:
    if text in (None, ""):
        return None
    try:
        return float(text) if str(text).replace(".", "", 1).isdigit() else parse_rate(text) * 60
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _until(text: Any) -> float | None:
    if text in (None, ""):
        return None
    try:
        return time.time() + parse_duration(str(text))
    except ValueError as exc:
        raise CommandError(f"bad duration: {exc}") from None
