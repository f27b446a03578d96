"""Which pacing a destination gets: the [[shaping.destinations]] rule that names it.

    pacing_for(shaping, domain, mx_hosts) -> Pacing
    stated_rate(shaping, domain, mx_hosts, named_hop=False) -> messages a minute (0: none)
    NAMED_HOP_RATE

A rule names a destination by its domain or by a suffix of any of its MX host names (a
provider's many domains share its MX hosts); the first that matches wins, over
shaping.default.
"""

from __future__ import annotations

from collections.abc import Iterable

from .. import config


def pacing_for(
    shaping: config.ShapingConfig, domain: str, mx_hosts: Iterable[str]
) -> config.Pacing:
    """The pacing of a destination: the first [[shaping.destinations]] rule whose `domain`
    is the domain, or whose `mx_suffix` ends any MX host name, over shaping.default.

    Names compare without case or a trailing dot. A suffix with a leading dot
    (".google.com") matches by the end of the name; one without ("google.com") matches
    that name and its subdomains, not "notgoogle.com"."""
    rule = _rule_for(shaping, domain, mx_hosts)
    return rule.over(shaping.default) if rule else shaping.default


# Where a next hop the operator named (delivery.relayhost, a route, a class's or tenant's
# smarthost) starts without history, messages a minute: not in slow start. Slow start (2/s,
# doubling each 0.25 s) is for a provider nobody told us about; it took ~2.5 s of every
# burst to a relayhost, a third of bench/delivery_bench.py's throughput (bench/RESULTS.md,
# "End-to-end throughput after 639f883"). Postfix paces a relayhost by nothing at all; a
# throttle signal still cuts this rate to what the hop took (rate_learner.py).
NAMED_HOP_RATE = 60_000.0


def stated_rate(
    shaping: config.ShapingConfig,
    domain: str,
    mx_hosts: Iterable[str],
    *,
    named_hop: bool = False,
) -> float:
    """The messages a minute a [[shaping.destinations]] rule gives this destination, 0 if
    none. An admin who names a destination's rate knows that provider: a destination with
    no history starts there instead of in slow start. shaping.default's rate says nothing
    of any one provider: it stays a ceiling over the slow start. `named_hop`: the
    destination is a next hop the operator configured, not the recipient domain's own MX;
    without a rule's rate it starts at NAMED_HOP_RATE (under the ceiling, if any)."""
    rule = _rule_for(shaping, domain, mx_hosts)
    rate = (rule.messages_per_minute or 0.0) if rule else 0.0
    return rate or (NAMED_HOP_RATE if named_hop else 0.0)


def _rule_for(
    shaping: config.ShapingConfig, domain: str, mx_hosts: Iterable[str]
) -> config.DestinationRule | None:
    domain = _name(domain)
    hosts = [_name(host) for host in mx_hosts]
    for rule in shaping.destinations:
        if rule.domain and _name(rule.domain) == domain:
            return rule
        if rule.mx_suffix and any(_under(host, _name(rule.mx_suffix)) for host in hosts):
            return rule
    return None


def _name(name: str) -> str:
    return name.lower().removesuffix(".")


def _under(host: str, suffix: str) -> bool:
    if suffix.startswith("."):
        return host.endswith(suffix)
    return host == suffix or host.endswith("." + suffix)
