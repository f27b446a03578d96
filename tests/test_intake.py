"""The intake (delivery/intake.py) with the real core, active window and queue index: the
start-up read lets the first class in first, and due mail beyond the window's room waits
in line, the first class ahead."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from msgspec.structs import replace

from mtaqueue import config
from mtaqueue.config import DEFAULT_CLASSES
from mtaqueue.delivery.intake import Intake
from mtaqueue.delivery.notices import Notices
from mtaqueue.delivery.outcomes import Outcomes
from mtaqueue.delivery.registry import Registry
from mtaqueue.delivery.tasks import Tasks
from mtaqueue.model import Message, Recipient
from mtaqueue.scheduler.actions import Dispatch
from mtaqueue.scheduler.active import ActiveWindow
from mtaqueue.scheduler.core import STARTUP, Scheduler
from mtaqueue.spool.records import MessageMap

T0 = 1_000_000.0
CLASSES = {name: (c.priority, c.weight) for name, c in DEFAULT_CLASSES.items()}


def message(queue_id: str, klass: str, next_attempt: float | None = None) -> Message:
    rcpt = Recipient(f"{queue_id}@example.org", next_attempt=next_attempt)
    return Message(queue_id, "app@example.com", (rcpt,), T0 - 60, 100, klass)


def intake(messages: list[Message], active: ActiveWindow, spread: float = 3600.0):
    index = MessageMap()
    for m in messages:
        index.put(m)
    spool = SimpleNamespace(messages=index)  # only its index is read
    cfg = config.Config()
    cfg = replace(cfg, retry=replace(cfg.retry, restart_spread=config.Duration(spread)))
    core = Scheduler(CLASSES, max_connections=10, connection_idle=5.0)
    tasks = Tasks()
    notices = Notices(spool, "mx.test", cfg, tasks)  # type: ignore[arg-type]
    registry = Registry(core, spool)  # type: ignore[arg-type]
    outcomes = Outcomes(spool, active, core, registry, notices, tasks, random.Random(1))  # type: ignore[arg-type]
    outcomes.started = True
    reader = Intake(spool, active, outcomes, random.Random(1), lambda: T0)  # type: ignore[arg-type]
    reader.configure(cfg, "p0")
    return reader, core


def test_the_start_up_read_lets_the_first_class_in_at_once_and_spreads_the_rest():
    messages = [message("later", "p1", T0 + 300), message("bulk", "p2"), message("reset", "p0")]
    active = ActiveWindow(chunk=10)
    reader, core = intake(messages, active)

    async def read() -> list:
        return [
            a
            async for actions in reader.read_queue(["later", "bulk", "reset"], T0)
            for a in actions
        ]

    asyncio.run(read())
    assert core.inserted[STARTUP] == 3
    assert active.admitted == {"bulk", "reset"}  # overdue: they hold room until dispatched
    (due_now,) = [a for a in core.tick(T0) if isinstance(a, Dispatch)]
    assert due_now.message_ids == ("reset",)  # p0 at once; p2 spread over the next hour
    dispatched = [a for a in core.tick(T0 + 3600) if isinstance(a, Dispatch)]
    assert set(dispatched[0].message_ids) == {"later", "bulk"}  # within the hour both


def test_due_mail_beyond_the_room_waits_in_line_the_first_class_ahead():
    messages = [message(f"b{i}", "p2") for i in range(3)] + [message("reset", "p0")]
    active = ActiveWindow(chunk=2, limit=3)
    reader, _ = intake(messages, active)
    route_now, lined_up = reader.admit(["b0", "b1", "b2", "reset"])
    assert route_now == [] and lined_up  # four due, room for three: all wait in line

    async def let_through() -> list[list[str]]:
        chunks = []
        async for chunk in reader.let_through():
            chunks.append(chunk)
            active.occupy(chunk[0]).add(0)  # the first of each chunk stays in transit
        return chunks

    assert asyncio.run(let_through()) == [["reset"], ["b0", "b1"], ["b2"]]


def test_due_mail_within_the_room_goes_at_once_and_admitted_mail_always_does():
    messages = [message("a", "p2"), message("b", "p2")]
    active = ActiveWindow(chunk=10, limit=5)
    reader, _ = intake(messages, active)
    active.admit("a")
    assert reader.admit(["a", "b"]) == (["a", "b"], False)
