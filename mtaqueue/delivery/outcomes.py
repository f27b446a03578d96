"""What an attempt got, settled: the record's new state, its journal write, DSNs, events.

    Outcomes(spool, active, core, registry, notices, tasks, rng)
    .configure(cfg, sender, first_class)      settings of a start or a reload
    .schedule(message_id, due, now, reason)   -> actions (none before delivery starts)
    .finish(id, indexes, results, destination=, now=, retry_factor=)   -> actions
    .apply(settlement, now)                   -> actions: events, DSNs, suppressions, journal
    .charge(id, indexes, reply, destination, now)      a failure of ours as an attempt
    .retry_later(id, indexes, error, now)     after a bug: uncharged once, then charged
    .unqueue(predicate, now) / .unqueue_messages(ids, now)   out of the ready queues
    .on_delivery                              each "delivery" event (metrics)

The plan is policy/settle.py's (pure); this room writes it. A record whose DSNs are not
yet durable is journaled once they are, so a stop meanwhile makes them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable

from .. import config
from ..events.derive import DONE
from ..logs import get_logger
from ..model import HELD_BY_ERROR, PENDING, Message, with_hold
from ..policy.backoff import RetryPolicy
from ..policy.replies import Reply
from ..policy.settle import Result, Settlement, SettleSettings, settle
from ..scheduler.actions import Action
from ..scheduler.active import ActiveWindow
from ..scheduler.core import RECOVER, RETRY, Scheduler
from ..spool.store import Spool
from .destination import WorkItem
from .notices import Notices
from .registry import Registry
from .sender import Sender
from .tasks import Tasks

log = get_logger("delivery")

RECOVER_AFTER = 60.0  # retry delay after an unexpected error (a bug): not an attempt


class Outcomes:
    def __init__(
        self,
        spool: Spool,
        active: ActiveWindow,
        core: Scheduler,
        registry: Registry,
        notices: Notices,
        tasks: Tasks,
        rng: random.Random,
    ) -> None:
        self.spool = spool
        self.active = active
        self.core = core
        self.registry = registry
        self.notices = notices
        self.tasks = tasks
        self.rng = rng
        self.started = False  # delivery.enabled = false: the start schedules the queue
        self.on_delivery: Callable[[dict], None] | None = None
        # message id -> the journaling of its record, waiting for its DSNs to be durable
        self._noticing: dict[str, asyncio.Future] = {}

    def configure(self, cfg: config.Config, sender: Sender, first_class: str) -> None:
        self.cfg = cfg
        self.sender = sender
        self._settings = {
            name: SettleSettings(
                retry=RetryPolicy.from_config(cfg.retry, first_class=name == first_class),
                lifetime=c.lifetime,
                expire_action=c.expire_action,
                on_sender_block=c.on_sender_block,
                delay_after=cfg.dsn.delay_after,
                delay_without_notify=cfg.dsn.delay_without_notify,
            )
            for name, c in cfg.classes.items()
        }

    def settings(self, klass: str) -> SettleSettings:
        # A class removed by a reload: its queued mail follows the default class.
        return self._settings.get(klass) or self._settings[self.cfg.submission.default_class]

    def schedule(self, message_id: str, due: float, now: float, reason: str) -> list[Action]:
        """Into the scheduled queue, for `reason` (scheduler/core.py's REASONS)."""
        if not self.started:
            return []
        return self.core.schedule(now, message_id, due, reason)

    def finish(
        self,
        message_id: str,
        indexes: list[int],
        results: list[Result],
        *,
        destination: str,
        now: float,
        retry_factor: float = 1.0,
    ) -> list[Action]:
        self.active.free(message_id, indexes)
        self.active.attempted(message_id)  # internal waits and refusals count from here
        message = self.spool.messages.get(message_id)
        if message is None:
            return []
        settings = self.settings(message.klass)
        settlement = settle(message, results, now, self.rng, settings, retry_factor=retry_factor)
        relay = self.registry.relay_named(destination)
        for event in settlement.events:
            if event.get("event") == "delivery":
                event["destination"] = destination
                event["class"] = message.klass
                if relay is not None:
                    event["relay"] = relay.source
        return self.apply(settlement, now)

    def apply(self, settlement: Settlement, now: float) -> list[Action]:
        message = settlement.message
        for event in settlement.events:
            if event["event"] == "delivery" and self.on_delivery is not None:
                self.on_delivery(event)
            name = event.pop("event")
            log.info(name, **event)
        notices = [
            self.notices.notify(message, reports, kind, now)
            for kind, reports in (
                ("failure", settlement.failed),
                ("delay", settlement.delayed),
                ("success", settlement.succeeded),
            )
            if reports
        ]
        if self.cfg.suppression.enabled:
            for address, reason in settlement.suppress:
                future = self.spool.suppress(address, now + self.cfg.suppression.ttl, reason)
                journal(future, message.id)
                log.info("suppressed", address=address, reason=reason)
        finished = settlement.finished and not self.active.busy.get(message.id)
        if finished:
            self.active.end(message.id)
        earlier = self._noticing.get(message.id)
        if notices or earlier is not None:
            # Its DSNs must be durable before a record that shows the recipients they
            # report as done (or the original's end): kept in memory only until then, so
            # that a stop meanwhile (a disk still too full for them) leaves the record as
            # it was, to be tried and its DSNs made again. A later record waits its turn.
            self.spool.show(message)
            waits = notices if earlier is None else [*notices, earlier]
            self._noticing[message.id] = self.tasks.spawn(
                self._journal_when_noticed(message, finished, waits)
            )
        elif finished:
            journal(self.spool.remove(message.id, DONE, message), message.id)
        else:
            journal(self.spool.update(message), message.id)
        due = None if finished else earliest_due(message)
        return [] if due is None else self.schedule(message.id, due, now, RETRY)

    async def _journal_when_noticed(
        self, message: Message, finished: bool, notices: list[asyncio.Future]
    ) -> bool:
        """True once `message`'s record (its end, if `finished`) follows its durable DSNs."""
        noticed = all(await asyncio.gather(*notices))
        me = asyncio.current_task()
        if self._noticing.get(message.id) is me:
            del self._noticing[message.id]
        if not noticed:  # a bug, logged: the record stays, for an operator (or a restart)
            log.error("original_kept", id=message.id, reason="its DSN could not be queued")
            return False
        if finished:
            journal(self.spool.remove(message.id, DONE, message), message.id)
        elif self._noticing.get(message.id) is None:  # the latest record: journal it
            latest = self.spool.messages.get(message.id)
            if latest is not None:
                journal(self.spool.update(latest), message.id)
        return True

    def charge(
        self, message_id: str, indexes: list[int], reply: Reply, destination: str, now: float
    ) -> list[Action]:
        """Settle a failure of ours as an attempt of these recipients. A record that cannot
        even be settled is held for an operator (mtaqueue-ctl show / release): kept, and
        not tried again and again."""
        try:
            results = [self.sender.result(i, reply, None, None) for i in indexes]
            return self.finish(message_id, indexes, results, destination=destination, now=now)
        except Exception:
            log.exception("settle_failed", id=message_id)
            self.active.free(message_id, indexes)
            message = self.spool.messages.get(message_id)
            if message is not None:
                with contextlib.suppress(Exception):  # logged above; it waits for a restart
                    held = with_hold(message, HELD_BY_ERROR, now)
                    journal(self.spool.update(held), message_id)
            return []

    def retry_later(
        self, message_id: str, indexes: list[int] | None, error: Exception | None, now: float
    ) -> list[Action]:
        """After an unexpected error (a bug): free the recipients and try again later,
        uncharged the first time; a repeat counts as an attempt that failed with it.
        `indexes` None: every pending recipient."""
        if indexes is not None:
            self.active.free(message_id, indexes)
        message = self.spool.messages.get(message_id)
        if message is None:
            return []
        if indexes is None:
            indexes = [i for i, r in enumerate(message.recipients) if r.state in PENDING]
        if self.active.uncharged_wait(message_id):
            return self.schedule(message_id, now + RECOVER_AFTER, now, RECOVER)
        reply = Reply("dns", 0, "", f"local error: {type(error).__name__}: {error}", "local")
        return self.charge(message_id, indexes, reply, "", now)

    def attempt_failed(
        self, message_id: str, indexes: list[int], destination: str, exc: Exception, now: float
    ) -> list[Action]:
        """An attempt raised (a bug of ours outside the SMTP client, which reports its own):
        it counts, as a local error, rather than coming back every minute uncharged."""
        reply = Reply("mail", 0, "", f"local error: {type(exc).__name__}: {exc}", "local")
        return self.charge(message_id, indexes, reply, destination, now)

    def unqueue(self, predicate: Callable[[WorkItem], bool], now: float) -> None:
        """Take waiting items out of the ready queues (held, deleted, bounced, expired)."""
        for item in self.core.remove(now, predicate):
            self.active.free(item.message_id, item.indexes)

    def unqueue_messages(self, ids: set[str], now: float) -> None:
        """Take these messages' items out of the ready queues. That looks at every item
        queued, so only when one of them has recipients routed (an item in the core is
        always of busy recipients): a revalidation's hold or cancel, one message at a time,
        must not scan the whole active window each."""
        if any(self.active.busy.get(i) for i in ids):
            self.unqueue(lambda item: item.message_id in ids, now)


def journal(future: asyncio.Future, message_id: str) -> None:
    """Log a journal write that failed. The record in memory stays current (a lost
    update costs at worst one more attempt; a lost remove, a message delivered again
    after a restart), so the queue goes on; the spool refuses new mail meanwhile."""

    def done(future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.error("journal_write_failed", id=message_id, error=str(future.exception()))

    future.add_done_callback(done)


def earliest_due(message: Message) -> float | None:
    """When the next pending recipient is due (0 for one never tried); None if none."""
    dues = [r.next_attempt or 0.0 for r in message.recipients if r.state in PENDING]
    return min(dues) if dues and not message.held else None
