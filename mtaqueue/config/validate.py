"""`validate(cfg)`: the checks of a converted Config that span keys or need more than a type:
addresses, regexes, rates, and what classes, tenants, pools, webhooks and DKIM keys name.

The first problem raises ConfigError naming the key.
"""

import ipaddress
import itertools
import re
from collections.abc import Callable
from typing import Any

from .addresses import check_network, parse_nameserver, split_host_port, valid_host
from .delivery_schema import PoolConfig, RelayConfig, dkim_path
from .errors import ConfigError
from .schema import EVENT_TYPES, Config
from .units import parse_rate


def _check(path: str, check: Callable[..., object], *args: Any) -> None:
    try:
        check(*args)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def validate(cfg: Config) -> None:
    """Checks that span keys or need more than a type."""
    listen, retry = cfg.listen, cfg.retry
    # Port 0 binds an ephemeral port (tests); the "ready" log event names it.
    _check("listen.address", lambda a: split_host_port(a, min_port=0), listen.address)
    for i, network in enumerate(listen.mynetworks):
        _check(f"listen.mynetworks[{i}]", check_network, network)
    for i, network in enumerate(listen.client_limit_exceptions):
        if network != "mynetworks":
            _check(f"listen.client_limit_exceptions[{i}]", check_network, network)
    if bool(listen.tls_cert) != bool(listen.tls_key):
        missing, given = ("tls_key", "tls_cert") if listen.tls_cert else ("tls_cert", "tls_key")
        raise ConfigError(f"listen.{missing}: required when listen.{given} is set")
    if listen.max_line_length < 998:
        raise ConfigError("listen.max_line_length: must be at least 998 (RFC 5322 2.1.1)")
    if listen.auth_required and not listen.auth_file:
        raise ConfigError("listen.auth_required: needs listen.auth_file")
    positive = {
        "listen.command_timeout": listen.command_timeout,
        "listen.data_timeout": listen.data_timeout,
        "dns.timeout": cfg.dns.timeout,
        "mta_sts.fetch_timeout": cfg.mta_sts.fetch_timeout,
        "alerts.interval": cfg.alerts.interval,
    } | {f"classes.{name}.lifetime": c.lifetime for name, c in cfg.classes.items()}
    for path, seconds in positive.items():
        if seconds <= 0:
            raise ConfigError(f"{path}: must be more than 0s")
    if cfg.submission.default_class not in cfg.classes:
        defined = ", ".join(cfg.classes)
        raise ConfigError(
            f"submission.default_class: unknown class {cfg.submission.default_class!r}"
            f" (defined: {defined})"
        )
    if not cfg.spool.path:
        raise ConfigError("spool.path: must not be empty")
    if cfg.metrics.address:
        _check("metrics.address", lambda a: split_host_port(a, min_port=0), cfg.metrics.address)
    for i, server in enumerate(cfg.dns.nameservers):
        _check(f"dns.nameservers[{i}]", parse_nameserver, server)
    if cfg.delivery.relayhost:
        _check("delivery.relayhost", split_host_port, cfg.delivery.relayhost, cfg.delivery.port)
    for domain, hop in cfg.routes.items():
        if not valid_host(domain) or ":" in domain:
            raise ConfigError(f"routes.{domain}: invalid domain")
        # "" routes the domain by its MX records, bypassing delivery.relayhost.
        if hop:
            _check(f"routes.{domain}", split_host_port, hop, cfg.delivery.port)
    for i, rule in enumerate(cfg.delivery.rules):
        try:
            re.compile(rule.match)
        except re.error as exc:
            raise ConfigError(f"delivery.rules[{i}].match: invalid regex: {exc}") from None
    if cfg.delivery.max_rate:
        _check("delivery.max_rate", parse_rate, cfg.delivery.max_rate)
    if cfg.shaping.tenant_rate:
        _check("shaping.tenant_rate", parse_rate, cfg.shaping.tenant_rate)
    for i, rule in enumerate(cfg.shaping.destinations):
        if bool(rule.domain) == bool(rule.mx_suffix):
            raise ConfigError(f"shaping.destinations[{i}]: give exactly one of domain, mx_suffix")
    for i, rule in enumerate(cfg.shaping.throttle_rules):
        try:
            re.compile(rule.match)
        except re.error as exc:
            raise ConfigError(f"shaping.throttle_rules[{i}].match: invalid regex: {exc}") from None
    if cfg.dsn.klass not in cfg.classes:
        raise ConfigError(f"dsn.class: unknown class {cfg.dsn.klass!r}")
    relays = {f"classes.{n}": c for n, c in cfg.classes.items()}
    relays |= {f"tenants.{n}": t for n, t in cfg.tenants.items()}
    for path, relay in relays.items():
        _validate_relay(path, relay, cfg.delivery.port)
        if relay.pool and relay.pool not in cfg.pools:
            raise ConfigError(f"{path}.pool: unknown pool {relay.pool!r}")
    for name, pool in cfg.pools.items():
        _validate_pool(f"pools.{name}", pool)
    for name, klass in cfg.classes.items():
        if klass.revalidate_after < 0:
            raise ConfigError(f"classes.{name}.revalidate_after: must not be negative")
        if klass.revalidate_after and not cfg.revalidate.url:
            raise ConfigError(f"classes.{name}.revalidate_after: needs revalidate.url")
    if cfg.revalidate.url:
        _check("revalidate.url", _check_url, cfg.revalidate.url)
    _validate_webhooks(cfg)
    _validate_dkim(cfg)
    if cfg.api.address:
        _check("api.address", lambda a: split_host_port(a, min_port=0), cfg.api.address)
    if len(retry.then) != 2:
        raise ConfigError(f"retry.then: expected two durations [min, max], got {len(retry.then)}")
    if retry.then[0] > retry.then[1]:
        raise ConfigError("retry.then: min is greater than max")


def _validate_pool(path: str, pool: PoolConfig) -> None:
    if not pool.sources:
        raise ConfigError(f"{path}.sources: name at least one address")
    seen: set[str] = set()
    for i, source in enumerate(pool.sources):
        address = source if isinstance(source, str) else source.address
        try:
            address = str(ipaddress.ip_address(address))
        except ValueError:
            raise ConfigError(f"{path}.sources[{i}]: not an IP address: {address!r}") from None
        if address in seen:
            raise ConfigError(f"{path}.sources[{i}]: {address} is named twice")
        seen.add(address)
        steps = [] if isinstance(source, str) else source.warmup
        if any(n <= 0 for n in steps) or any(a >= b for a, b in itertools.pairwise(steps)):
            raise ConfigError(f"{path}.sources[{i}].warmup: use increasing numbers above 0")
    if pool.blocklist_hold <= 0:
        raise ConfigError(f"{path}.blocklist_hold: must be more than 0s")
    if not 0 <= pool.warmup_spread <= 86400:
        raise ConfigError(f"{path}.warmup_spread: must be from 0s to 1d")


def _check_url(url: str) -> None:
    if re.fullmatch(r"https?://[^/\s]+(/\S*)?", url) is None:
        raise ValueError(f"invalid URL {url!r} (expected http://host[:port]/path or https://...)")


def _validate_relay(path: str, relay: RelayConfig, default_port: int) -> None:
    if relay.relayhost:
        _check(f"{path}.relayhost", split_host_port, relay.relayhost, default_port)
    for key in ("relay_user", "relay_tls_ca"):
        if getattr(relay, key) and not relay.relayhost:
            raise ConfigError(f"{path}.{key}: needs {path}.relayhost")
    if bool(relay.relay_user) != bool(relay.relay_password_file):
        missing = "relay_password_file" if relay.relay_user else "relay_user"
        raise ConfigError(f"{path}.{missing}: required with the other AUTH key")


def _validate_webhooks(cfg: Config) -> None:
    names: set[str] = set()
    for i, hook in enumerate(cfg.webhooks):
        path = f"webhooks[{i}]"
        _check(f"{path}.url", _check_url, hook.url)
        if not hook.secret and not hook.secret_file:
            raise ConfigError(f"{path}.secret: required (or secret_file): events are signed")
        for kind in hook.events:
            if kind not in EVENT_TYPES:
                known = ", ".join(EVENT_TYPES)
                raise ConfigError(f"{path}.events: unknown event type {kind!r} (known: {known})")
        for klass in hook.classes:
            if klass not in cfg.classes:
                raise ConfigError(f"{path}.classes: unknown class {klass!r}")
        name = hook.name or hook.url
        if name in names:
            raise ConfigError(f"{path}.name: {name!r} names another webhook too")
        names.add(name)
        if hook.timeout <= 0 or hook.max_age <= 0:
            raise ConfigError(f"{path}: timeout and max_age must be more than 0s")


_SELECTOR_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_FIELD_NAME_RE = re.compile(r"[!-9;-~]+")  # RFC 5322 ftext


def _validate_dkim(cfg: Config) -> None:
    """What can be checked without the key files (the daemon reads those: dkim/keys.py)."""
    domains: set[str] = set()
    for domain, keys in cfg.dkim.items():
        if not valid_host(domain) or ":" in domain or "." not in domain.strip("."):
            raise ConfigError(f"{dkim_path(domain)}: invalid domain")
        if domain.lower().rstrip(".") in domains:
            raise ConfigError(f"{dkim_path(domain)}: the domain has another [dkim] table too")
        domains.add(domain.lower().rstrip("."))
        selectors = set()
        for i, key in enumerate(keys):
            path = dkim_path(domain, i if len(keys) > 1 else None)
            if not all(_SELECTOR_RE.fullmatch(label) for label in key.selector.split(".")):
                raise ConfigError(f"{path}.selector: invalid selector {key.selector!r}")
            if key.selector.lower() in selectors:
                raise ConfigError(f"{path}.selector: {key.selector!r} names another key too")
            selectors.add(key.selector.lower())
            if not key.key_file:
                raise ConfigError(f"{path}.key_file: must not be empty")
            for name in key.headers:
                if _FIELD_NAME_RE.fullmatch(name) is None:
                    raise ConfigError(f"{path}.headers: {name!r} is not a header field name")
            if key.headers and "from" not in (name.lower() for name in key.headers):
                raise ConfigError(f"{path}.headers: must include From (RFC 6376 5.4)")
