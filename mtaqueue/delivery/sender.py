"""One delivery attempt over SMTP: pick a host, connect (or reuse), send, read replies.

The results are raw (`Reply`) plus their classification (`Verdict`); what to do
about them is the manager's and the policy's business.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .. import config
from ..logs import get_logger
from ..model import Message
from ..policy.classify import Rule, classify
from ..policy.hosts import HostSuspensions
from ..policy.replies import Reply
from ..policy.settle import Result
from ..routing.resolver import Route
from ..smtp.client import ClientSettings, ConnectFailed, SmtpConnection

log = get_logger("delivery")


@dataclass(slots=True)
class Outcome:
    results: list[Result]  # empty when nothing was tried
    conn: SmtpConnection | None  # still open, for the next message
    wait_until: float | None = None  # every host suspended: an internal wait, not an attempt
    connect_failures: int = 0  # failed connections on the way (for the circuit breaker)
    latency: float | None = None  # connect + greeting of a new connection, seconds


class Sender:
    def __init__(
        self,
        client: ClientSettings,
        rules: tuple[Rule, ...],
        hosts: HostSuspensions,
        delivery: config.DeliveryConfig,
    ) -> None:
        self.client = client
        self.rules = rules
        self.hosts = hosts
        self.delivery = delivery

    async def send(
        self,
        message: Message,
        indexes: list[int],
        route: Route,
        content: bytes,
        conn: SmtpConnection | None,
        max_per_connection: int,
    ) -> Outcome:
        """Try the route's hosts in order until one takes the transaction."""
        now = time.time()
        hosts = [h for h in route.hosts if not self.hosts.suspended(h.name, now)]
        if not hosts:
            release = self.hosts.next_release([h.name for h in route.hosts], now)
            return Outcome([], conn, wait_until=release or now + self.delivery.host_suspend)
        if conn is not None and not (
            conn.usable
            and conn.transactions < max_per_connection
            and any(conn.ip in h.addresses for h in hosts)
        ):
            await conn.quit()
            conn = None
        outcome = Outcome([], conn)
        last: Reply | None = None
        last_host = None
        candidates = [(h, ip) for h in hosts for ip in h.addresses]
        if conn is not None:  # the open connection first
            candidates.sort(key=lambda c: c[1] != conn.ip)
        for host, ip in candidates:
            if conn is None or conn.ip != ip:
                if conn is not None:
                    await conn.quit()
                started = time.monotonic()
                opened = await self._connect(host.name, ip, route.port)
                if isinstance(opened, Reply):
                    last, last_host, conn = opened, host.name, None
                    outcome.connect_failures += 1
                    continue
                conn = opened
                outcome.latency = time.monotonic() - started
            outcome.results = await self._transaction(conn, message, indexes, content)
            self.hosts.succeeded(host.name)
            if not conn.usable:
                await conn.quit()
                conn = None
            outcome.conn = conn
            return outcome
        assert last is not None
        outcome.results = [self.result(i, last, last_host, None) for i in indexes]
        outcome.conn = None
        return outcome

    async def _connect(self, host: str, ip: str, port: int) -> SmtpConnection | Reply:
        now = time.time()
        try:
            return await SmtpConnection.open(host, ip, port, self.client)
        except ConnectFailed as failed:
            if failed.reply.phase == "starttls" and self.client.tls == "opportunistic":
                try:  # opportunistic TLS: a broken handshake falls back to clear text
                    return await SmtpConnection.open(host, ip, port, self.client, use_tls=False)
                except ConnectFailed as again:
                    failed = again
            verdict = classify(failed.reply, self.rules)
            if verdict.scope in ("host", "destination"):
                until = self.hosts.failed(host, now)
                log.warning(
                    "host_suspended", host=host, ip=ip, until=until, reply=failed.reply.line()
                )
            return failed.reply

    async def _transaction(
        self, conn: SmtpConnection, message: Message, indexes: list[int], content: bytes
    ) -> list[Result]:
        """Send to these recipients; those refused as "too many" go in further transactions
        on the same connection (RFC 5321 4.5.3.1.10), as long as each one makes progress."""
        results: list[Result] = []
        pending = list(indexes)
        while pending:
            rcpts = [message.recipients[i] for i in pending]
            replies = await conn.send(message, rcpts, content, self.delivery.timeouts)
            outcomes = [
                self.result(i, reply, conn.host, conn.ip, relayed=not conn.dsn)
                for i, reply in zip(pending, replies, strict=True)
            ]
            again = [r.index for r in outcomes if r.verdict.kind == "too_many_recipients"]
            if not again or len(again) == len(pending) or not conn.usable:
                return results + outcomes
            results += [r for r in outcomes if r.verdict.kind != "too_many_recipients"]
            pending = again
        return results

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
