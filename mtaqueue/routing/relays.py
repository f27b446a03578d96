"""Routes by class and by tenant: a message's class's relayhost wins, then its tenant's,
then each recipient domain's own route (nexthop.py: routes, delivery.relayhost, MX).

A smarthost is a destination of its own (`Relay.key`): its pacing, circuit breaker, backoff
and learned rate are not those of the domains it carries mail for. Tables that name one
smarthost with one user are one destination (one account at the provider, one set of
limits); with different users, one destination each, so that one account's wrong password
stops only its own mail.

Pure: the password and the CA file are read by the delivery side (delivery/smarthosts.py).
"""

from __future__ import annotations

import msgspec

from .. import config
from .nexthop import NextHop, parse_hop
from .resolver import RouteFailure

IMPLICIT = "implicit"  # TLS from the first byte (SMTPS, port 465)
STARTTLS = "starttls"  # STARTTLS, required: no clear-text fallback
SMTPS_PORT = 465


class Relay(msgspec.Struct, frozen=True):
    key: str  # destination name: "relay:smtp.esp.example:587", "relay:acct@smtp.esp.example:587"
    source: str  # the table that names it first ("classes.p0"), for messages and logs
    hop: NextHop
    user: str = ""  # "" = no AUTH
    password_file: str = ""
    tls: str = ""  # IMPLICIT, STARTTLS, or "" = as delivery.tls (no AUTH then)
    ca_file: str = ""  # required TLS verifies against it; "" = the system's CA store


class Relays:
    """The relays by class and by tenant."""

    def __init__(self, classes: dict[str, Relay], tenants: dict[str, Relay]) -> None:
        self.classes = classes
        self.tenants = tenants

    def for_message(self, klass: str, tenant: str | None) -> Relay | None:
        """Where all of a message's recipients go: its class's relay, else its tenant's;
        None: each recipient's domain is routed on its own."""
        relay = self.classes.get(klass)
        if relay is None and tenant is not None:
            relay = self.tenants.get(tenant)
        return relay

    def by_key(self) -> dict[str, Relay]:
        return {r.key: r for r in (*self.classes.values(), *self.tenants.values())}


def tls_mode(table: config.RelayConfig, port: int) -> str:
    """IMPLICIT, STARTTLS (required) or "" (delivery.tls). "auto" is implicit TLS on port
    465, else STARTTLS, required with AUTH (a password never goes in clear text) or with a
    CA to verify against (asked for, so meant)."""
    if table.relay_tls == IMPLICIT or (table.relay_tls == "auto" and port == SMTPS_PORT):
        return IMPLICIT
    if table.relay_tls == STARTTLS or table.relay_user or table.relay_tls_ca:
        return STARTTLS
    return ""


def relay_key(hop: NextHop, user: str) -> str:
    host = f"[{hop.host}]" if ":" in hop.host else hop.host
    return f"relay:{user}@{host}:{hop.port}" if user else f"relay:{host}:{hop.port}"


def relays(cfg: config.Config) -> Relays:
    """The relays the config names (checked by config.load). Raises ConfigError when two
    tables name one destination (smarthost and user) with different settings."""
    seen: dict[str, Relay] = {}

    def relay(source: str, table: config.RelayConfig) -> Relay:
        hop = parse_hop(table.relayhost, cfg.delivery.port)
        user = table.relay_user
        made = Relay(
            key=relay_key(hop, user),
            source=source,
            hop=hop,
            user=user,
            password_file=table.relay_password_file,
            tls=tls_mode(table, hop.port),
            ca_file=table.relay_tls_ca,
        )
        first = seen.setdefault(made.key, made)
        if msgspec.structs.replace(made, source=first.source) != first:
            raise config.ConfigError(
                f"{source}.relayhost: {made.key} is {first.source}'s too, with other settings"
                " (one smarthost and user is one destination: give both the same relayhost,"
                " relay_password_file, relay_tls and relay_tls_ca)"
            )
        return first

    classes = {
        name: relay(f"classes.{name}", table)
        for name, table in cfg.classes.items()
        if table.relayhost
    }
    tenants = {
        name: relay(f"tenants.{name}", table)
        for name, table in cfg.tenants.items()
        if table.relayhost
    }
    return Relays(classes, tenants)


def unrouted(relay: Relay, failure: RouteFailure) -> RouteFailure:
    """A smarthost that does not resolve is a mistake or a DNS outage on our side: the mail
    through it is deferred (4.4.3), never bounced for it (NXDOMAIN included)."""
    if not failure.permanent:
        return failure
    text = f"smarthost {failure.text}; deferred, not bounced: check {relay.source}.relayhost"
    return RouteFailure(False, "4.4.3", text)
