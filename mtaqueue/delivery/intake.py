"""Mail coming into the active window: the queue read at start, and due mail beyond room.

    Intake(spool, active, outcomes, rng, clock)
    .configure(cfg, first_class)
    .read_queue(message_ids, now) -> async iterator of actions   the start-up read
    .admit(message_ids) -> (route_now, line_up)   what goes now; whether a line waits
    .let_through() -> async iterator of message-id chunks, as room frees

A million messages take seconds to read: neither the listener nor the first deliveries
wait for the rest. Mail not yet due waits in the core's heap; overdue mail is let into the
active window as it has room (Postfix's qmgr_message_active_limit), the first class
first, the rest spread over retry.restart_spread.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import msgspec

from .. import config
from ..logs import get_logger
from ..model import Message
from ..policy.backoff import restart_due
from ..scheduler.actions import Action
from ..scheduler.active import ActiveWindow
from ..scheduler.core import STARTUP
from ..spool.store import Spool
from ..spool.walk import WALK_CHUNK, chunks
from .outcomes import Outcomes, earliest_due

log = get_logger("delivery")

RELEASE_POLL = 0.1  # seconds between looks for room in the active window


class Intake:
    def __init__(
        self,
        spool: Spool,
        active: ActiveWindow,
        outcomes: Outcomes,
        rng: random.Random,
        clock: Callable[[], float],
    ) -> None:
        self.spool = spool
        self.active = active
        self.outcomes = outcomes
        self.rng = rng
        self.clock = clock
        self.closing = False

    def configure(self, cfg: config.Config, first_class: str) -> None:
        self.restart_spread = cfg.retry.restart_spread
        self.first_class = first_class

    def read(self, message_id: str) -> Message | None:
        """A message for a walk over the queue; None if gone, or if its record does not
        decode (replay checks only a record's head): logged, and left as it is."""
        try:
            return self.spool.messages.get(message_id)
        except msgspec.DecodeError as exc:
            log.error("record_undecodable", id=message_id, error=str(exc))
            return None

    async def read_queue(self, message_ids: list[str], now: float) -> AsyncIterator[list[Action]]:
        """Schedule the queue found at start, a chunk at a time."""
        later: list[str] = []  # overdue, not of the first class: after it
        for chunk in chunks(message_ids):
            actions: list[Action] = []
            for message_id in chunk:
                message = self.read(message_id)
                due = None if message is None else earliest_due(message)
                if due is None:
                    continue
                if due > now:  # not due yet: it waits in the heap
                    actions += self.outcomes.schedule(message_id, due, now, STARTUP)
                elif message.klass == self.first_class:
                    yield actions
                    actions = [] if self.closing else await self._let_in(message_id, due, 0.0)
                else:
                    later.append(message_id)
            yield actions
            await asyncio.sleep(0)
        for message_id in later:
            message = self.read(message_id)  # again: it may have changed meanwhile
            due = None if message is None else earliest_due(message)
            if due is not None and not self.closing:
                yield await self._let_in(message_id, due, self.restart_spread)

    async def _let_in(self, message_id: str, due: float, window: float) -> list[Action]:
        """Schedule overdue mail found at start once the active window has room."""
        while self.active.room() <= 0 and not self.closing:
            await asyncio.sleep(RELEASE_POLL)
        self.active.admit(message_id)  # until dispatched
        now = self.clock()
        due = restart_due(due, now, window, self.rng)
        return self.outcomes.schedule(message_id, due, now, STARTUP)

    def admit(self, message_ids: tuple[str, ...] | list[str]) -> tuple[list[str], bool]:
        """Due mail: what is routed now (a chunk at a time) and whether the rest waits in
        line for room (`let_through`): a flush of a million must neither route and queue
        them all at once nor hold the event loop while it reads them."""
        admitted = self.active.admitted
        now_ids = [i for i in message_ids if i in admitted]  # let in: they hold room
        rest = [i for i in message_ids if i not in admitted] if admitted else list(message_ids)
        if self.active.waiting() or len(rest) > min(WALK_CHUNK, self.active.room()):
            heads = self.spool.messages
            first = set()
            lined = []
            for message_id in rest:
                head = heads.head(message_id)
                if head is not None:
                    lined.append(message_id)
                    if head.klass == self.first_class:
                        first.add(message_id)
            self.active.line_up(lined, first)
            return now_ids, True
        return now_ids + rest, False

    async def let_through(self) -> AsyncIterator[list[str]]:
        """The mail waiting in line, a chunk at a time, as the active window has room."""
        while self.active.waiting() and not self.closing:
            chunk = self.active.take()
            if not chunk:
                await asyncio.sleep(RELEASE_POLL)
                continue
            yield chunk
            await asyncio.sleep(0)
