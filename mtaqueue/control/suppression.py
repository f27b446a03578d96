"""The suppression list's operations, and the control commands over them (`suppress
list|add|remove`); the HTTP API's /v1/suppressions calls the same operations."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from mtaqueue.config import parse_duration
from mtaqueue.control.server import Command, CommandError
from mtaqueue.smtp.addresses import AddressError, check_mailbox
from mtaqueue.spool.store import Spool

DEFAULT_REASON = "added by an operator"
_T = TypeVar("_T")


def active(spool: Spool, now: float) -> list[dict[str, Any]]:
    """The suppressions in force, by address."""
    return [
        {"address": entry.address, "until": entry.until, "reason": entry.reason}
        for entry in sorted(spool.suppressed.values(), key=lambda e: e.address)
        if entry.until > now
    ]


async def add(spool: Spool, address: str, ttl: float, reason: str) -> dict[str, Any]:
    """Suppress `address` (checked) for `ttl` seconds; returns the entry once durable."""
    until = time.time() + ttl
    await spool.suppress(address, until, reason)
    return {"address": address.lower(), "until": until, "reason": reason}


async def remove(spool: Spool, address: str) -> dict[str, Any] | None:
    """Lift the suppression of `address` once durable; None if it was not suppressed."""
    if spool.suppression(address, time.time()) is None:
        return None
    await spool.unsuppress(address)
    return {"address": address.lower(), "removed": True}


def checked_address(address: object) -> str:
    """The address, or ValueError saying what is wrong with it."""
    if not isinstance(address, str):
        raise ValueError("an address is needed")
    try:
        check_mailbox(address, utf8=True)
    except AddressError as exc:
        raise ValueError(f"invalid address {address!r}: {exc}") from None
    return address


def duration(value: object, default: float) -> float:
    """Seconds of a suppression's "for" ("7d", or a number of seconds; None: `default`),
    or ValueError."""
    try:
        return parse_duration(str(value or default))
    except ValueError as exc:
        raise ValueError(f"bad duration: {exc}") from None


def suppression_commands(spool: Spool, default_ttl: float) -> dict[str, Command]:
    async def list_(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        for entry in active(spool, time.time()):
            yield entry

    async def add_(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        address = _command(checked_address, args.get("address"))
        ttl = _command(duration, args.get("for"), default_ttl)
        yield await add(spool, address, ttl, str(args.get("reason") or DEFAULT_REASON))

    async def remove_(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        address = _command(checked_address, args.get("address"))
        removed = await remove(spool, address)
        if removed is None:
            raise CommandError(f"{address} is not suppressed")
        yield removed

    return {"suppress_list": list_, "suppress_add": add_, "suppress_remove": remove_}


def _command(check: Callable[..., _T], *args: Any) -> _T:
    """`check(*args)`, its ValueError the ctl's one-line error."""
    try:
        return check(*args)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
