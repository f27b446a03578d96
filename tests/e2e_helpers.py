"""Shared bits of the end-to-end delivery tests."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dns_server import DnsServer
from smtp_peer import SmtpPeer, peers_on_one_port

FAST = (
    "delivery.enabled=true",
    'retry.schedule=["2s", "4s"]',
    'retry.then=["6s", "8s"]',
    "retry.jitter=0.05",
    "retry.greylist_min=2s",
    "retry.restart_spread=0.5s",
    "delivery.host_suspend=3s",
    "delivery.timeouts.connect=2s",
    "delivery.timeouts.banner=3s",
    "dns.timeout=1s",
)
BODY = b"Subject: hello\r\nFrom: app@sender.test\r\n\r\nhello world\r\n"


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def queue_id(reply: bytes) -> str:
    """The id in the daemon's reply to the final dot."""
    assert reply.startswith(b"250 2.0.0 Ok: queued as "), reply
    return reply.split()[-1].decode()


def ctl_json(daemon, *args: str) -> list[dict]:
    """`mtaqueue-ctl ARGS --json`, which must succeed: its objects."""
    result = daemon.ctl(*args, "--json")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def events(daemon, name: str) -> list[dict]:
    return [e for e in daemon.events if e.get("event") == name]


class MailNet:
    """A test DNS server and SMTP peers on loopback addresses, all on one port.

    `peers` are in the order of the addresses given; `peer_options` go to every peer, and
    `per_host[address]` to that one's (a peer with another TLS context, say).
    Use as a context manager, or call close(): it stops the peers, then the DNS server.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        per_host: Mapping[str, dict[str, Any]] | None = None,
        **peer_options: Any,
    ) -> None:
        self.dns = DnsServer().start()
        try:
            self.peers: list[SmtpPeer] = peers_on_one_port(
                list(addresses), per_host, **peer_options
            )
        except BaseException:
            self.dns.stop()
            raise
        self._a_records: dict[str, str] = {}

    def add_domain(self, domain: str, *addresses: str, host: str | None = None) -> None:
        """Publish MX records for `domain`, one host per address, preferences 10, 20, ...

        The hosts are mx.<domain> for one address, mx1.<domain>, mx2.<domain>, ... for
        more; or `host`, for one address, when several domains share an MX host (its A
        record is published once).
        """
        if host is not None:
            if len(addresses) != 1:
                raise TypeError("host names a single MX host: give one address")
            names = [host]
        elif len(addresses) == 1:
            names = [f"mx.{domain}"]
        else:
            names = [f"mx{i}.{domain}" for i in range(1, len(addresses) + 1)]
        for i, name in enumerate(names, start=1):
            self.dns.add(domain, "MX", f"{10 * i} {name}")
        for name, address in zip(names, addresses, strict=True):
            if name not in self._a_records:
                self.dns.add(name, "A", address)
                self._a_records[name] = address
            elif self._a_records[name] != address:
                raise ValueError(f"{name} already points at {self._a_records[name]}")

    def daemon_overrides(self) -> tuple[str, str]:
        """The daemon's overrides to resolve through this DNS server and deliver to the peers."""
        return f'dns.nameservers=["{self.dns.address}"]', f"delivery.port={self.peers[0].port}"

    def close(self) -> None:
        for peer in self.peers:
            peer.stop()
        self.dns.stop()

    def __enter__(self) -> MailNet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
