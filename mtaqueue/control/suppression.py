"""Control commands for the suppression list: `suppress list|add|remove`."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from mtaqueue.config import parse_duration
from mtaqueue.control.server import Command, CommandError
from mtaqueue.smtp.addresses import AddressError, check_mailbox
from mtaqueue.spool.store import Spool


def suppression_commands(spool: Spool, default_ttl: float) -> dict[str, Command]:
    async def list_(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        now = time.time()
        for entry in sorted(spool.suppressed.values(), key=lambda e: e.address):
            if entry.until > now:
                yield {"address": entry.address, "until": entry.until, "reason": entry.reason}

    async def add(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        address = _address(args)
        try:
            ttl = parse_duration(str(args.get("for") or default_ttl))
        except ValueError as exc:
            raise CommandError(f"bad duration: {exc}") from None
        reason = str(args.get("reason") or "added by an operator")
        until = time.time() + ttl
        await spool.suppress(address, until, reason)
        yield {"address": address.lower(), "until": until, "reason": reason}

    async def remove(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        address = _address(args)
        if spool.suppression(address, time.time()) is None:
            raise CommandError(f"{address} is not suppressed")
        await spool.unsuppress(address)
        yield {"address": address.lower(), "removed": True}

    return {"suppress_list": list_, "suppress_add": add, "suppress_remove": remove}


def _address(args: dict[str, Any]) -> str:
    address = args.get("address")
    if not isinstance(address, str):
        raise CommandError("an address is needed")
    try:
        check_mailbox(address, utf8=True)
    except AddressError as exc:
        raise CommandError(f"invalid address {address!r}: {exc}") from None
    return address
