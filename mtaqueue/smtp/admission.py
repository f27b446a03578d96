"""Who gets a slot of the submission listener: the global and per-client caps, and stress.

    Slots(Limits(max_connections, per_client, exceptions, hostname, stress timeouts))
    .configure(limits)                   a reload
    .admit(session, now) -> str | None   a refusal line, or None: it holds a slot now
    .release(session, now)               it is gone
    .check(now)                          the stress mode (the listener's sweep calls it)
    .command_timeout(normal) / .data_timeout(normal) -> seconds   shrunk under stress
    .sessions, .per_client, .stress, .shed_count
    in_networks(client, networks) -> bool

A session is anything with `client`, `in_data`, `quiet(now)` and `give_way(reply)` (the
listener's SubmissionProtocol). What gives way, and when the listener is under stress, is
smtp/stress.py's; this file keeps the counts, logs the changes and asks a session
to go. Logs: `listener_stress` (state entered/left, sessions, max, the busiest address and
its slots) and `session_shed` (client, quiet seconds, for whom).
"""

from __future__ import annotations

import functools
import ipaddress
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from ..logs import get_logger
from .stress import SessionView, Stress, shed

log = get_logger("listener")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Session(Protocol):
    client: str

    @property
    def in_data(self) -> bool: ...

    def quiet(self, now: float) -> float: ...

    def give_way(self, reply: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """The listener's settings that the slots follow (a reload replaces them)."""

    max_connections: int
    per_client: int
    exceptions: tuple[Network, ...]  # addresses the per-client cap spares
    hostname: str  # said in the refusals
    stress_command_timeout: float
    stress_data_timeout: float


class Slots:
    def __init__(self, limits: Limits) -> None:
        self.sessions: set[Session] = set()
        self.per_client: Counter[str] = Counter()
        self.shed_count = 0
        self.stress = Stress(limits.max_connections)
        self.configure(limits)

    def configure(self, limits: Limits) -> None:
        self.limits = limits
        self.stress.max_connections = limits.max_connections

    def admit(self, session: Session, now: float) -> str | None:
        client = session.client
        if self.per_client[client] >= self.limits.per_client and not in_networks(
            client, self.limits.exceptions
        ):
            return f"421 4.7.0 {self.limits.hostname} Error: too many connections from your address"
        if len(self.sessions) >= self.limits.max_connections and not self._make_room(client, now):
            return f"421 4.7.0 {self.limits.hostname} Error: too many connections, try again later"
        self.sessions.add(session)
        self.per_client[client] += 1
        self.check(now)
        return None

    def release(self, session: Session, now: float) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            self.per_client[session.client] -= 1
            if self.per_client[session.client] <= 0:
                del self.per_client[session.client]
            self.check(now)

    def check(self, now: float) -> None:
        change = self.stress.update(len(self.sessions))
        if change is not None:
            client, slots = (self.per_client.most_common(1) or [("", 0)])[0]
            (log.warning if change == "entered" else log.info)(
                "listener_stress",
                state=change,
                sessions=len(self.sessions),
                max=self.limits.max_connections,
                busiest=client or None,
                busiest_slots=slots,
            )

    def command_timeout(self, normal: float) -> float:
        """The deadline for one command line: shorter under stress (Postfix's
        `${stress?{10}:{300}}s`)."""
        return min(normal, self.limits.stress_command_timeout) if self.stress.active else normal

    def data_timeout(self, normal: float) -> float:
        """How far ahead message data may earn its deadline: shorter under stress (a
        client sending at listen.min_data_rate or more never comes near it)."""
        return min(normal, self.limits.stress_data_timeout) if self.stress.active else normal

    def _make_room(self, newcomer: str, now: float) -> bool:
        """Every slot is taken: the quietest session of the busiest address gives way, if
        one has been quiet long enough (stress.shed)."""
        views = [SessionView(s, s.client, s.quiet(now), s.in_data) for s in self.sessions]
        victim = shed(views, newcomer)
        if victim is None:
            return False
        session: Session = victim  # type: ignore[assignment]  # the key is the session
        log.info(
            "session_shed", client=session.client, quiet=round(session.quiet(now), 1), to=newcomer
        )
        self.shed_count += 1
        self.release(session, now)
        hostname = self.limits.hostname
        session.give_way(
            f"421 4.3.2 {hostname} Service busy: closing this quiet session to serve others"
        )
        return True


def in_networks(client: str, networks: tuple[Network, ...]) -> bool:
    ip = _client_ip(client)
    return ip is not None and any(ip in net for net in networks)


@functools.lru_cache(maxsize=4096)
def _client_ip(client: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A client's address parsed (cached: the same few clients connect all day)."""
    try:
        return ipaddress.ip_address(client)
    except ValueError:
        return None
