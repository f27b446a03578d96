"""The next hop for a recipient domain: a per-domain route, the relay host, or the domain's MX.

Next hops use Postfix's syntax: "[host]:port" or "[host]" connects to the host itself (its
A/AAAA, or an IP address), "host:port" or "host" looks up the MX records of host.
"""

from __future__ import annotations

import functools
import ipaddress

import msgspec

from mtaqueue.config import split_host_port


class NextHop(msgspec.Struct, frozen=True):
    host: str  # lower-case domain or host name, or an IP address
    port: int
    mx: bool  # True: look up MX records of host; False: connect to host itself


def next_hop(domain: str, relayhost: str, routes: dict[str, str], default_port: int) -> NextHop:
    """Where mail for `domain` goes: routes[domain] ("" = the domain's own MX, bypassing the
    relay host), else the relay host, else the domain's MX."""
    domain = domain.lower()
    hop = routes.get(domain)
    if hop is None:
        hop = relayhost
    if not hop:
        return _own(domain, default_port)
    return parse_hop(hop, default_port)


@functools.lru_cache(maxsize=1024)  # a few configured hops, parsed once each, not per message
def parse_hop(text: str, default_port: int) -> NextHop:
    """A configured next hop ("[host]:port", "host:port", "host"), checked by config."""
    host, port = split_host_port(text, default_port)
    # An IP address has no MX records, bracketed or not.
    return NextHop(host.lower(), port, mx=not text.startswith("[") and not is_ip_address(host))


def _own(domain: str, port: int) -> NextHop:
    # An address literal ("[192.0.2.1]", "[IPv6:2001:db8::1]") names the host itself.
    if domain.startswith("[") and domain.endswith("]"):
        return NextHop(domain[1:-1].removeprefix("ipv6:"), port, mx=False)
    return NextHop(domain, port, mx=True)


def is_ip_address(host: str) -> bool:
    return literal_address(host) is not None


@functools.lru_cache(maxsize=1024)
def literal_address(host: str) -> str | None:
    """The address a host literal names, written canonically; None: a name. (Cached: a
    relayhost's literal is looked at for every message.)"""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None
