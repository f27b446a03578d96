"""The SMTP side of delivery: which hosts to try, one connection, one transaction.

Whether a connection may open and which message goes on it is the scheduler core's
decision (scheduler/core.py); the pool (delivery/connections.py) drives this for it.

The results are raw (`Reply`) plus their classification (`Verdict`); what to do
about them is the pool's and the policy's business (delivery/outcomes.py, policy/settle.py).
"""

from __future__ import annotations

import dataclasses
import ssl
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import msgspec

from .. import config
from ..logs import get_logger
from ..model import Message
from ..policy.classify import Rule, classify
from ..policy.hosts import EVERY, HostSuspensions, host_key
from ..policy.mta_sts import AS_USUAL, VERIFY, requirement
from ..policy.pipelining import OutOfStep
from ..policy.replies import Reply
from ..policy.settle import Result
from ..policy.shaper import REFUSALS_PER_CONNECTION
from ..policy.tls_report import Session, result_type
from ..policy.verdict import (
    ABOUT_US,
    AUTH,
    DELIVERED,
    HOST,
    IPV6,
    THROTTLING,
    TOO_MANY_RECIPIENTS,
)
from ..routing.pools import Source, family_of
from ..routing.relays import STARTTLS
from ..routing.resolver import Route
from ..routing.sts import Applied
from ..smtp.client import ClientSettings, ConnectFailed, Follow, Smarthost, SmtpConnection
from ..smtp.pipeline import Ahead, Pending
from . import mta_sts

log = get_logger("delivery")

_OURS = ABOUT_US | {AUTH, IPV6}  # failures about us, not the host: they suspend none


@dataclass(frozen=True, slots=True)
class Suspended:
    """Every host of a route is suspended: an internal wait, not an attempt."""

    until: float
    reply: Reply  # why, should the wait have to be charged


class Sender:
    def __init__(
        self,
        client: ClientSettings,
        rules: tuple[Rule, ...],
        hosts: HostSuspensions,
        delivery: config.DeliveryConfig,
        sts_context: ssl.SSLContext | None = None,
        out_of_step: OutOfStep | None = None,
    ) -> None:
        self.client = client
        self.rules = rules
        self.hosts = hosts
        # Outlives a reload, as `hosts` (`is None`: an empty one is falsy, yet the one to share).
        self.out_of_step = OutOfStep() if out_of_step is None else out_of_step
        self.delivery = delivery
        # MTA-STS: STARTTLS required, the certificate verified for the MX name (as a
        # smarthost's required TLS is, smtp/client.py).
        self._sts_tls = Smarthost(STARTTLS, sts_context) if sts_context is not None else None
        self.on_tls: Callable[[Session], None] | None = None  # each TLS attempt (TLS-RPT)

    def candidates(
        self,
        route: Route,
        now: float,
        families: Collection[int] = (4, 6),
        source: Source | None = None,
    ) -> list[tuple[str, str]] | Suspended:
        """The (host, address) pairs to try in order from `source`: the hosts not
        suspended for it, their addresses of `families` (a source's, or IPv4 for a site
        that refuses IPv6)."""
        port, by = route.port, _address(source)
        keys = [host_key(h.name, port) for h in route.hosts]
        hosts = [
            h
            for h, key in zip(route.hosts, keys, strict=True)
            if not self.hosts.suspended(key, now, by)
        ]
        if not hosts:
            release = self.hosts.next_release(keys, now, by)
            until = release or now + self.delivery.host_suspend
            return Suspended(until, self._suspended(keys, by))
        return [(h.name, ip) for h in hosts for ip in h.addresses if family_of(ip) in families]

    def all_suspended(self, route: Route, now: float, source: Source | None) -> bool:
        """Whether every host of `route` is suspended for `source` (a pool's other
        sources may still reach them)."""
        keys = (host_key(h.name, route.port) for h in route.hosts)
        return self.hosts.next_release(keys, now, _address(source)) is not None

    def suspended_hosts(self, now: float, source: Source | None) -> dict[str, float]:
        """The hosts suspended for `source`, and until when (`mtaqueue-ctl domains`)."""
        return self.hosts.snapshot(now, _address(source))

    def fits(
        self,
        conn: SmtpConnection,
        route: Route,
        now: float,
        families: Collection[int] = (4, 6),
        source: Source | None = None,
    ) -> bool:
        """Whether an open connection can carry mail of `route`: reusable, to one of its
        hosts not suspended over an address family still wanted, verified if the route's
        MTA-STS policy enforces (a connection opened for another domain of the same MX may
        not be)."""
        candidates = self.candidates(route, now, families, source)
        return (
            self.reusable(conn)
            and not isinstance(candidates, Suspended)
            and any(ip == conn.ip for _, ip in candidates)
            and (conn.verified or requirement(route.sts, conn.host) != VERIFY)
        )

    def reusable(self, conn: SmtpConnection) -> bool:
        """Whether an open connection may take another transaction: usable, and not past
        REFUSALS_PER_CONNECTION 4xx replies since it last delivered (a strict receiver's
        error tarpit is not fed)."""
        return conn.usable and conn.refusals < REFUSALS_PER_CONNECTION

    def judge_host(
        self, host: str, port: int, ip: str, results: list[Result], source: Source | None = None
    ) -> None:
        """A host that spoke out of step (a 250 greeting, 252 to MAIL, garbage) is left
        alone like one that failed to connect; one that carried a transaction is fine."""
        failed = next((r.reply for r in results if r.verdict.scope == HOST), None)
        if failed is None:
            self.hosts.succeeded(host_key(host, port), _address(source))
        else:
            self._suspend(host, port, ip, failed, source)

    def _suspend(self, host: str, port: int, ip: str, reply: Reply, source: Source | None) -> None:
        key, now = host_key(host, port), time.time()
        until = self.hosts.failed(key, now, reply, _address(source))
        log.warning(
            "host_suspended",
            host=host,
            port=port,
            ip=ip,
            source=source.address if source is not None else None,
            every_source=self.hosts.suspended(key, now, EVERY),
            until=until,
            reply=reply.line(),
        )

    def _suspended(self, keys: list[str], source: str) -> Reply:
        """What an attempt that waited on suspended hosts reports, if it has to be charged:
        the failure that suspended the first of them."""
        reason = self.hosts.reason(keys[0], source)
        note = f"(delivery to {keys[0]} temporarily suspended)"
        if reason is None:
            return Reply("connect", 0, "", note, network="unreachable")
        # (An event's line is "[enhanced] text or its description": the text alone here.)
        text = reason.text if reason.code else reason.line().removeprefix(reason.enhanced)
        return msgspec.structs.replace(reason, text=f"{text.strip()} {note}")

    async def connect(
        self,
        host: str,
        ip: str,
        port: int,
        last_one: bool,
        smarthost: Smarthost | None = None,
        sts: Applied | None = None,
        source: Source | None = None,
        *,
        suspend: bool = True,
        domain: str = "",
    ) -> SmtpConnection | Reply:
        """`last_one`: no other host is left to try (see `tries_next`); `smarthost`: the
        relay's TLS and AUTH, for a relay destination; `sts`: the recipient domain's
        MTA-STS policy, for an MX destination; `source`: the pool's address to bind and
        its EHLO name; `suspend` False: a failure does not suspend the host (another of
        its addresses is tried next); `domain`: the recipient domain whose own MX `host`
        is, whose TLS result is counted (TLS-RPT)."""
        client = self.client
        if source is not None:
            helo = source.helo or client.helo_name
            client = dataclasses.replace(client, helo_name=helo, source=source.address)
        tls = _TlsOutcome(self.on_tls if domain else None, domain, sts, host, ip)
        try:
            need = requirement(sts, host) if self._sts_tls is not None else AS_USUAL
            if sts is None or need == AS_USUAL:
                conn = await self._open(host, ip, port, smarthost, client, tls)
            else:
                conn = await self._open_sts(host, ip, port, sts, need, client, tls)
            if conn.tls:
                tls.succeeded()
            if conn.pipeline is not None:
                conn.pipeline.lockstep = self.out_of_step.lockstep(ip, time.time())
            return conn
        except ConnectFailed as failed:
            if failed.reply.phase == "starttls":
                tls.failed(failed)
            verdict = classify(failed.reply, self.rules)
            paced = last_one and verdict.kind == THROTTLING
            # Refused credentials are ours, not the host's: the destination's breaker (by
            # smarthost and user) holds them, not a suspension of a host others may use;
            # so is a refused source (listed, reputation) or an IPv6 address the site will
            # not take from us.
            ours = verdict.kind in _OURS or failed.reply.network == "local"
            if verdict.scope in ("host", "destination") and suspend and not paced and not ours:
                self._suspend(host, port, ip, failed.reply, source)
            return failed.reply

    async def _open(
        self,
        host: str,
        ip: str,
        port: int,
        smarthost: Smarthost | None,
        client: ClientSettings,
        tls: _TlsOutcome,
    ) -> SmtpConnection:
        try:
            return await SmtpConnection.open(host, ip, port, client, smarthost=smarthost)
        except ConnectFailed as failed:
            required = smarthost is not None and smarthost.tls  # never in clear text then
            if failed.reply.phase != "starttls" or client.tls != "opportunistic" or required:
                raise
            tls.failed(failed)
            # Opportunistic TLS: a broken handshake falls back to clear text.
            return await SmtpConnection.open(
                host, ip, port, client, use_tls=False, smarthost=smarthost
            )

    async def _open_sts(
        self,
        host: str,
        ip: str,
        port: int,
        sts: Applied,
        need: str,
        client: ClientSettings,
        tls: _TlsOutcome,
    ) -> SmtpConnection:
        """TLS with a certificate valid for the MX name. Without it: enforce defers
        (never clear text); testing logs the violation and delivers as usual."""
        try:
            conn = await SmtpConnection.open(host, ip, port, client, smarthost=self._sts_tls)
        except ConnectFailed as failed:
            reply = failed.reply
            if reply.phase != "starttls":  # the host's failure, not a TLS one
                raise
            enforced = need == VERIFY
            action = "deferred" if enforced else "delivered as usual"
            mta_sts.violation(sts, host, reply.text, action, ip)
            tls.failed(failed)  # before the fallback's own TLS, which is not the policy's
            if not enforced:
                return await self._open(host, ip, port, None, client, tls)
            why = f"{reply.text} (MTA-STS: {sts.domain} requires TLS with a valid certificate)"
            raise ConnectFailed(msgspec.structs.replace(reply, text=why)) from None
        conn.verified = True
        return conn

    def tries_next(self, reply: Reply, last_one: bool) -> bool:
        """Whether a connect that failed with `reply` goes on to the next address. A
        throttling greeting from the last host ("421 4.7.0 Error: too many connections
        from ...") is the destination pacing us: it suspends no host (the only MX would
        stop all delivery) and ends the try. From one of several, the next is tried.
        Refused AUTH ends it too: every address would refuse the same credentials, and
        each failed login counts against the account; so does a reply about our sending
        (the site refuses our source, whatever its host) and a source we cannot bind."""
        kind = classify(reply, self.rules).kind
        if kind == AUTH or kind in ABOUT_US or reply.network == "local":
            return False
        return not (last_one and kind == THROTTLING)

    async def transaction(
        self,
        conn: SmtpConnection,
        message: Message,
        indexes: list[int],
        content: bytes,
        follow: Follow | None = None,
    ) -> list[Result]:
        """Send to these recipients; those refused as "too many" go in further transactions
        on the same connection (RFC 5321 4.5.3.1.10), as long as each one makes progress.
        `follow`: the next transaction to write behind this one's final dot (client.send),
        unless recipients are left for another transaction here."""
        results: list[Result] = []
        pending = list(indexes)
        while pending:
            rcpts = [message.recipients[i] for i in pending]
            replies = await conn.send(
                message, rcpts, content, self.delivery.timeouts, self._unless_more(follow)
            )
            self._learn_step(conn)
            outcomes = [
                self.result(i, reply, conn.host, conn.ip, relayed=not conn.dsn)
                for i, reply in zip(pending, replies, strict=True)
            ]
            _count_refusals(conn, outcomes)
            again = [r.index for r in outcomes if r.verdict.kind == TOO_MANY_RECIPIENTS]
            if not again or len(again) == len(pending) or not conn.usable:
                return results + outcomes
            results += [r for r in outcomes if r.verdict.kind != TOO_MANY_RECIPIENTS]
            pending = again
        return results

    def _unless_more(self, follow: Follow | None) -> Follow | None:
        """`follow`, unless a recipient was refused as one too many: the rest go next."""
        if follow is None:
            return None

        async def unless_more(pending: Pending) -> Ahead | None:
            for reply in pending.judged.recipients:
                if reply is not None and classify(reply, self.rules).kind == TOO_MANY_RECIPIENTS:
                    return None
            return await follow(pending)

        return unless_more

    def _learn_step(self, conn: SmtpConnection) -> None:
        """A host that answered a pipelined group out of step is spoken to in lock-step
        from now on (policy/pipelining.py)."""
        pipeline = conn.pipeline
        if pipeline is not None and pipeline.out_of_step and not pipeline.lockstep:
            pipeline.lockstep = True
            self.out_of_step.learned(conn.ip, time.time())
            log.warning("pipelining_out_of_step", host=conn.host, ip=conn.ip)

    def result(
        self,
        index: int,
        reply: Reply,
        host: str | None,
        ip: str | None,
        *,
        relayed: bool = False,
    ) -> Result:
        verdict = classify(reply, self.rules, ambiguous_policy=self.delivery.ambiguous)
        return Result(index, reply, verdict, host, ip, dsn_relayed=relayed)


class _TlsOutcome:
    """One connection's TLS result, counted once (a testing-mode fallback that then gets
    unverified TLS is still the failure), if `report` is given."""

    def __init__(
        self,
        report: Callable[[Session], None] | None,
        domain: str,
        sts: Applied | None,
        host: str,
        ip: str,
    ) -> None:
        self._report, self._session = report, Session(domain, sts, host, ip)

    def succeeded(self) -> None:
        self._count()

    def failed(self, failed: ConnectFailed) -> None:
        reply = failed.reply
        kind = result_type(reply.text, reply.code)
        self._count(kind, reply.line()[:300], failed.local)

    def _count(self, failure: str = "", reason: str = "", source: str = "") -> None:
        if self._report is not None:
            session = msgspec.structs.replace(
                self._session, failure=failure, reason=reason, source=source
            )
            self._report(session)
            self._report = None


def _address(source: Source | None) -> str:
    """A source's name in the host suspensions: its address; "" the default source."""
    return source.address if source is not None else ""


def _count_refusals(conn: SmtpConnection, results: list[Result]) -> None:
    """4xx replies since the connection last delivered (a strict receiver's error tarpit,
    Postfix's smtpd_soft_error_limit, slows and then drops a session that draws many)."""
    if any(r.verdict.outcome == DELIVERED for r in results):
        conn.refusals = 0
    else:
        conn.refusals += len({id(r.reply) for r in results if r.reply.code // 100 == 4})
