"""The queue-inspection commands the daemon serves on its control socket."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

import msgspec

from mtaqueue.control import views
from mtaqueue.control.qshape import qshape
from mtaqueue.control.server import Command, CommandError
from mtaqueue.model import Message


def queue_commands(
    messages: Callable[[], Iterable[Message]],
    get: Callable[[str], Message | None],
    info: Callable[[], dict[str, Any]],
) -> dict[str, Command]:
    """`status`, `list` and `show` over the daemon's queue.

    `messages` may return a live view (a dict's values): it is copied before the
    first await, so the queue can change while a long list is being sent.
    """

    async def status(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        yield views.status_json(messages(), info())

    async def list_(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        try:
            filters = msgspec.convert(args, views.Filters)
        except msgspec.ValidationError as exc:
            raise CommandError(f"bad list filter: {exc}") from None
        for msg in list(messages()):
            if views.matches(msg, filters):
                yield views.message_json(msg)

    async def show(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        queue_id = args.get("id")
        if not isinstance(queue_id, str):
            raise CommandError("show needs a message id")
        msg = get(queue_id)
        if msg is None:
            raise CommandError(f"no message with id {queue_id}")
        yield views.message_json(msg)

    async def qshape_(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        by = args.get("by") or "domain"
        if by not in ("domain", "sender", "tenant"):
            raise CommandError("--by takes domain, sender or tenant")
        top = args.get("top") or 20
        if not isinstance(top, int) or top < 1:
            raise CommandError("--top takes a whole number of at least 1")
        for row in qshape(list(messages()), time.time(), by=by, klass=args.get("class"), top=top):
            yield row

    return {"status": status, "list": list_, "show": show, "qshape": qshape_}
