"""Addresses in config values: `split_host_port` ("host:port", "[host]:port"),
`parse_nameserver` ("ip", "ip:port"), `valid_host` (a host name or an IPv6 address) and
`check_network` (a CIDR).

They raise ValueError (valid_host answers False); validate.py names the key.
"""

import ipaddress
import re

_PORT_RE = re.compile(r"[0-9]{1,5}")
_LABEL_RE = re.compile(r"[A-Za-z0-9_-]{1,63}")


def valid_host(host: str) -> bool:
    if ":" in host:
        try:
            return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
        except ValueError:
            return False
    labels = host.removesuffix(".").split(".")
    return len(host) <= 253 and all(_LABEL_RE.fullmatch(label) for label in labels)


def split_host_port(
    text: str, default_port: int | None = None, *, min_port: int = 1
) -> tuple[str, int]:
    """Split "host:port" or "[host]:port" (IPv6, or a Postfix-style next hop without MX
    lookup); with a default_port the port may be left out. The host comes back unbracketed:
    callers that care whether it was bracketed check ``text.startswith("[")``."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"invalid address {text!r} (expected [host]:port)")
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    elif ":" in text:
        raise ValueError(f"invalid address {text!r} (put an IPv6 address in brackets: [::1]:25)")
    else:
        host, port = text, None
    if not valid_host(host):
        raise ValueError(f"invalid host in {text!r}")
    if port is None:
        if default_port is None:
            raise ValueError(f"missing port in {text!r} (expected host:port)")
        return host, default_port
    if _PORT_RE.fullmatch(port) is None or not min_port <= int(port) <= 65535:
        raise ValueError(f"invalid port in {text!r}")
    return host, int(port)


def parse_nameserver(text: str) -> tuple[str, int]:
    """(ip, port) from "ip", "ip:port" or "[ipv6]:port"; the port defaults to 53."""
    try:
        return str(ipaddress.ip_address(text)), 53
    except ValueError:
        pass
    try:
        host, port = split_host_port(text, default_port=53)
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        raise ValueError(f"invalid nameserver {text!r} (expected ip or ip:port)") from None


def check_network(text: str) -> None:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(f"invalid network {text!r} (expected CIDR, e.g. 10.0.0.0/8)") from None
