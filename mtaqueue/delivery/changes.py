"""Log lines for the operator about a destination: what changed, and whose fault it is.

    relay_refused(destination, host, ip, results)   a smarthost refusing our AUTH or TLS
    changed_since(destination, before, now, actions)   circuit or mode changed, lessons;
                                                       a site that refused our address
    learned_changes(destination, now)               learned limits that moved, latency cuts

Logs only: nothing here decides.
"""

from __future__ import annotations

from ..logs import get_logger
from ..policy.breaker import CLOSED, OPEN
from ..policy.settle import Result
from ..policy.shaper import ShaperState
from ..policy.verdict import AUTH, TLS
from ..scheduler.actions import Action, Release
from .destination import Destination

log = get_logger("delivery")


def relay_refused(destination: Destination, host: str, ip: str, results: list[Result]) -> None:
    """Log, for the operator, a smarthost that refuses our AUTH or our required TLS:
    ours to fix (the password file, relay_user, relay_tls, relay_tls_ca), and nothing
    goes there until it is. The mail is deferred, never bounced for it."""
    relay = destination.relay
    if relay is None:
        return
    for result in results:
        kind = result.verdict.kind
        if kind == AUTH or (kind == TLS and relay.tls):
            log.error(
                "relay_auth_failed" if kind == AUTH else "relay_tls_failed",
                destination=destination.key,
                relay=relay.source,
                user=relay.user or None,
                host=host,
                ip=ip,
                reply=result.reply.line(),
            )
            return


def changed_since(
    destination: Destination, before: ShaperState, now: float, actions: list[Action]
) -> None:
    after = destination.shaper.state(now)
    if after != before:
        released = sum(len(a.items) for a in actions if isinstance(a, Release))
        calm = after.circuit == CLOSED and after.mode == "normal"
        # A change of circuit or backoff mode (a time-based end is seen at the next
        # attempt), and how much waiting mail a probe that closed the circuit let go.
        (log.info if calm else log.warning)(
            "destination_changed",
            destination=destination.key,
            circuit=after.circuit,
            mode=after.mode,
            stage=after.stage,
            limit=destination.shaper.concurrency.limit,
            reply=destination.last_replies[-1] if destination.last_replies else None,
            released=released,
        )
    shaper = destination.shaper
    if after.circuit == OPEN != before.circuit and shaper.blocked_by is not None:
        # The site refuses our address: ours to act on (delisting, reputation), not a
        # message's or a recipient's; the mail waits (its class's on_sender_block).
        log.error(
            "sender_blocked",
            destination=destination.base,
            domains=sorted(destination.domains),
            source=destination.source.address if destination.source is not None else None,
            reply=shaper.blocked_by,
            until=shaper.breaker.reopen_at,
        )
    learned_changes(destination, now)


def learned_changes(destination: Destination, now: float) -> None:
    """Log the learned limits that moved (`limit_learned`)."""
    shaper = destination.shaper
    for change in shaper.changes():
        rate = change.what == "rate"  # logged per minute, as configured
        log.info(
            "limit_learned",
            destination=destination.key,
            what=change.what,
            old=round(change.old * 60, 2) if rate else change.old,
            new=round(change.new * 60, 2) if rate else change.new,
            reply=change.reply,
            probing=shaper.probing(now),
        )
    for step in shaper.latency_changes():
        # A cut for silent throttling (of the connections, or of the rate ceiling: then
        # `rate_new` < `rate_old`), or a step back up after one (docs/runbooks.md).
        (log.warning if step.kind else log.info)(
            "latency_slowed" if step.kind else "latency_recovered",
            destination=destination.key,
            old=step.old,
            new=step.new,
            rate_old=round(step.rate_old * 60, 2) or None,  # a minute, as configured
            rate_new=round(step.rate_new * 60, 2) or None,
            ratio=round(step.ratio, 2),
            kind=step.kind or None,
        )
