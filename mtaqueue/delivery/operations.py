"""Operator and API commands on the queue and its destinations (mtaqueue-ctl, the API).

    Operations(driver, outcomes, registry, active, spool, resolver, hosts)
    .configure(cfg)
    .hold(messages, reason) / .release(messages)
    .flush(messages, lifted) / .requeue(messages, lifted)    lifted: a command's, across chunks
    .delete(messages) / .cancel(messages, reason) / .bounce(messages)   -> count
    .limit(name, rate, concurrency, until) / .backoff(name, until)      -> destinations
    .forget_learned(name) -> count
    .unsuspend(host=, domain=) -> {"hosts": [...], "destinations": [...]}
    .suspended(now) -> [dict]                     mtaqueue-ctl hosts
    .revalidated(message_id, indexes, decision)   the application's answer (revalidation)

Each reads the clock once, changes records through the spool, and hands what the core
decides to the driver. A flush lifts what holds its mail back, as Postfix's `postqueue -f`
re-enables dead destinations (qmgr_enable_all): the host suspensions and an open breaker of
the destinations its mail was routed to. Each of those gets one probe connection (its
breaker half-open; once a command, however many chunks it comes in), whose answer
decides: a host still dead costs one connect and is suspended again, for longer.
Pacing, learned limits and the greylisting minimum still apply to what a flush releases:
it never hammers a receiver. `unsuspend` lifts the same way without touching retry
times: mail that waited on the suspension is due again at its own time.
"""

from __future__ import annotations

import msgspec

from .. import config
from ..logs import get_logger
from ..model import HELD_BY_OPERATOR, HELD_BY_REVALIDATION, Message, with_hold, without_hold
from ..policy.breaker import CLOSED
from ..policy.hosts import HostSuspensions, host_key
from ..policy.revalidate import CANCEL, HOLD
from ..policy.settle import bounce_now, flushed
from ..policy.shaper import DestinationShaper
from ..routing.resolver import Resolver
from ..scheduler.active import ActiveWindow
from ..scheduler.core import OPERATOR
from ..smtp.addresses import domain_of
from ..spool.store import Spool
from .destination import Destination
from .driver import Driver
from .outcomes import Outcomes, earliest_due, journal
from .registry import Registry, Steer

log = get_logger("delivery")


class Operations:
    def __init__(
        self,
        driver: Driver,
        outcomes: Outcomes,
        registry: Registry,
        active: ActiveWindow,
        spool: Spool,
        resolver: Resolver,
        hosts: HostSuspensions,
    ) -> None:
        self.driver = driver
        self.hosts = hosts
        self.outcomes = outcomes
        self.registry = registry
        self.active = active
        self.spool = spool
        self.resolver = resolver

    def configure(self, cfg: config.Config) -> None:
        self.greylist_min = cfg.retry.greylist_min

    def _schedule(self, message_id: str, due: float, now: float) -> None:
        self.driver.perform(self.outcomes.schedule(message_id, due, now, OPERATOR))

    def hold(self, messages: list[Message], reason: str = HELD_BY_OPERATOR) -> int:
        """Held mail is not attempted and does not expire until released."""
        now = self.driver.now()
        ids = {m.id for m in messages if not m.held}
        self.outcomes.unqueue_messages(ids, now)
        for message_id in ids:
            held = with_hold(self.spool.messages[message_id], reason, now)
            journal(self.spool.update(held), message_id)
        return len(ids)

    def release(self, messages: list[Message]) -> int:
        """Release held mail; it resumes its schedule (overdue mail is due now)."""
        now = self.driver.now()
        count = 0
        for message in messages:
            if message.held:
                released = without_hold(message)
                journal(self.spool.update(released), message.id)
                self._schedule(message.id, earliest_due(released) or 0.0, now)
                count += 1
        return count

    def flush(self, messages: list[Message], lifted: set[str]) -> int:
        """Make deferred mail due now (still paced), its destinations lifted (see above).
        `lifted`: the destinations this command lifted already (its chunks share it, and
        it grows here): each is lifted once a command, one probe, not one a chunk."""
        now = self.driver.now()
        ids = {m.id for m in messages if not m.held}
        # Only what something holds back, then whether this mail waits there: a flush of a
        # million messages comes a chunk at a time, and every destination's waiting mail
        # must not be scanned for each.
        held_back = [
            d
            for d in self.registry.destinations.values()
            if d.key not in lifted
            and (
                d.shaper.breaker.state(now) != CLOSED
                or any(self.hosts.held(key, now) for key in _host_keys(d))
            )
        ]
        waiting = [d for d in held_back if not d.waiting.isdisjoint(ids)]
        lifted.update(self._lift(waiting, now, "flush"))
        count = 0
        for message in messages:
            if message.held:
                continue
            recipients = [flushed(r, now, self.greylist_min) for r in message.recipients]
            message = msgspec.structs.replace(message, recipients=tuple(recipients))
            journal(self.spool.update(message), message.id)
            due = earliest_due(message)
            if due is not None:
                self._schedule(message.id, due, now)
                count += 1
        return count

    def requeue(self, messages: list[Message], lifted: set[str]) -> int:
        """Look the recipients' domains up again, then flush (still paced)."""
        for message in messages:
            for rcpt in message.recipients:
                self.resolver.cache.forget(domain_of(rcpt.address))
        return self.flush(messages, lifted)

    def delete(self, messages: list[Message]) -> int:
        """Remove messages without notice (an operator's decision, logged)."""
        return self.cancel(messages, "deleted by operator")

    def cancel(self, messages: list[Message], reason: str) -> int:
        """Remove messages without a DSN: the operator's delete, the application's cancel
        (API, revalidation). `reason` is journaled; any reason but DONE makes the
        recipients not yet final "cancelled" events."""
        ids = {m.id for m in messages}
        self.outcomes.unqueue_messages(ids, self.driver.now())
        for message in messages:
            self.active.end(message.id)
            journal(self.spool.remove(message.id, reason), message.id)
            log.info("deleted", id=message.id, sender=message.sender, reason=reason)
        return len(ids)

    def bounce(self, messages: list[Message]) -> int:
        """Fail messages now, with a DSN to their senders."""
        now = self.driver.now()
        ids = {m.id for m in messages}
        self.outcomes.unqueue(lambda item: item.message_id in ids, now)
        for message in messages:
            self.active.busy.pop(message.id, None)
            settlement = bounce_now(message, now, "550 5.0.0 returned by the administrator")
            self.driver.perform(self.outcomes.apply(settlement, now))
        return len(ids)

    def revalidated(self, message_id: str, indexes: list[int], decision: str) -> None:
        """The application's answer about a message set aside for it (revalidation.py):
        its recipients go on to routing, or it is cancelled (no DSN: the application said
        the mail no longer holds) or held for review. A message deleted, held or bounced
        meanwhile stays as the operator left it."""
        self.active.free(message_id, indexes)
        message = self.spool.messages.get(message_id)
        if message is None or message.held or self.driver.closing:
            return
        if decision == CANCEL:
            self.cancel([message], "cancelled by revalidation")
        elif decision == HOLD:
            self.hold([message], HELD_BY_REVALIDATION)
        else:  # the go-ahead is remembered: this dispatch is not checked again
            self.driver.route_due([message_id])

    # -- destinations ------------------------------------------------------------------

    def limit(self, name: str, rate: float | None, concurrency: int | None, until: float | None):
        """Runtime limits for a destination (by domain or destination name)."""

        def apply(shaper: DestinationShaper, now: float) -> None:
            shaper.override(now, rate_per_minute=rate, concurrency=concurrency, until=until)

        return self._steer(name, apply, until)

    def backoff(self, name: str, until: float) -> int:
        def apply(shaper: DestinationShaper, now: float) -> None:
            shaper.force_backoff(now, until)

        return self._steer(name, apply, until)

    def forget_learned(self, name: str) -> int:
        return self.registry.forget_learned(name, self.driver.now())

    def unsuspend(self, host: str | None = None, domain: str | None = None) -> dict:
        """Lift the suspension of `host` (a name, or name:port as `hosts` shows it), or of
        every host of the destinations serving `domain`; see the module's docstring."""
        now = self.driver.now()
        if domain is not None:
            destinations = self.registry.matching(domain.lower())
            named = {key for d in destinations for key in _host_keys(d)}
        else:
            wanted = (host or "").lower()
            named = {s.host for s in self.hosts.suspensions(now) if _names(s.host, wanted)}
            destinations = [
                d for d in self.registry.destinations.values() if named & set(_host_keys(d))
            ]
        lifted = sorted(key for key in named if self.hosts.lift(key, now))
        keys = self._lift(destinations, now, "unsuspend", probe=bool(lifted))
        for destination in destinations:
            for message_id in list(destination.waiting):
                message = self.spool.messages.get(message_id)
                due = earliest_due(message) if message is not None and not message.held else None
                if due is not None:
                    self._schedule(message_id, due, now)
        return {"hosts": lifted, "destinations": keys}

    def suspended(self) -> list[dict]:
        """The host suspensions in force, with the destinations using each host."""
        now = self.driver.now()
        using: dict[str, list[str]] = {}
        for destination in self.registry.destinations.values():
            for key in _host_keys(destination):
                using.setdefault(key, []).append(destination.key)
        return [
            {
                "host": s.host,
                "source": s.source or None,  # "*": every source (the host is down)
                "until": s.until,
                "failures": s.failures,
                "reply": s.reason.line() if s.reason is not None else None,
                "destinations": sorted(using.get(s.host, [])),
            }
            for s in self.hosts.suspensions(now)
        ]

    def _lift(
        self, destinations: list[Destination], now: float, by: str, *, probe: bool = False
    ) -> list[str]:
        """Lift the host suspensions and open breakers of `destinations` (`probe`: even
        if nothing of theirs was held back): one probe connection each may go now. The
        keys of those lifted."""
        keys = []
        for destination in destinations:
            hosts = [key for key in _host_keys(destination) if self.hosts.lift(key, now)]
            if probe or hosts or destination.shaper.breaker.state(now) != CLOSED:
                destination.shaper.probe(now)
                keys.append(destination.key)
                log.info("destination_lifted", destination=destination.key, hosts=hosts, by=by)
        if keys:
            self.driver.perform(self.driver.core.tick(now, *keys))
        return keys

    def _steer(self, name: str, apply: Steer, until: float | None) -> int:
        """Apply to matching destinations now, and to one that appears later (until
        `until`, if it ends)."""
        now = self.driver.now()
        keys = self.registry.steer(name, apply, now, until)
        # Idle connections over a lowered limit close; a raised one may open more.
        self.driver.perform(self.driver.core.tick(now, *keys))
        return len(keys)


def _host_keys(destination: Destination) -> list[str]:
    return [host_key(name, destination.port) for name in destination.hosts]


def _names(key: str, host: str) -> bool:
    """Whether the operator's `host` means host key `key` (see host_key): the key itself,
    or its name without the port."""
    if key.startswith("["):  # "[::1]:2525"
        name = key[1 : key.index("]")]
    else:  # "mx.example.org", "mx.example.org:2525", "::1" (port 25)
        name = key.split(":")[0] if key.count(":") == 1 else key
    return host in (key, name)
