"""The queue-inspection commands the daemon serves on its control socket."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import msgspec

from mtaqueue.control import views
from mtaqueue.control.qshape import QShape
from mtaqueue.control.server import Command, CommandError
from mtaqueue.model import Message
from mtaqueue.spool.walk import walk


def queue_commands(
    queue: Callable[[], Mapping[str, Message]],
    info: Callable[[], dict[str, Any]],
    waiting: Callable[[str], dict[str, Any] | None] = lambda queue_id: None,
) -> dict[str, Command]:
    """`status`, `list` and `show` over the daemon's queue (id -> message). The queue
    may change while a long list is being sent: each message is read as it comes.
    `waiting`: why the delivery side holds a message that its record shows as ready
    (DeliveryManager.waiting_for), None if it does not."""

    def entry(msg: Message) -> dict[str, Any]:
        return views.message_json(msg, waiting(msg.id))

    async def status(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        tally = views.StatusTally()
        async for msg in walk(queue()):
            tally.add(msg)
        yield tally.json(info())

    async def list_(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        try:
            filters = msgspec.convert(args, views.Filters)
        except msgspec.ValidationError as exc:
            raise CommandError(f"bad list filter: {exc}") from None
        async for msg in walk(queue()):
            if views.matches(msg, filters):
                yield entry(msg)

    async def show(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        queue_id = args.get("id")
        if not isinstance(queue_id, str):
            raise CommandError("show needs a message id")
        msg = queue().get(queue_id)
        if msg is None:
            raise CommandError(f"no message with id {queue_id}")
        yield entry(msg)

    async def qshape_(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        by = args.get("by") or "domain"
        if by not in ("domain", "sender", "tenant"):
            raise CommandError("--by takes domain, sender or tenant")
        top = args.get("top") or 20
        if not isinstance(top, int) or top < 1:
            raise CommandError("--top takes a whole number of at least 1")
        shape = QShape(time.time(), by=by, klass=args.get("class"))
        async for msg in walk(queue()):
            shape.add(msg)
        for row in shape.rows(top):
            yield row

    async def review(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """The review queue (views.in_review), longest waiting first."""
        klass = args.get("class")
        found: list[tuple[tuple[float, float, str], str]] = []
        async for msg in walk(queue()):
            if views.in_review(msg) and klass in (None, msg.klass):
                found.append((views.review_order(msg), msg.id))
        now = time.time()
        for _, queue_id in sorted(found):
            msg = queue().get(queue_id)
            if msg is not None and views.in_review(msg):  # still: the walk took a while
                yield views.review_json(msg, now)

    return {
        "status": status,
        "list": list_,
        "show": show,
        "qshape": qshape_,
        "review": review,
    }
