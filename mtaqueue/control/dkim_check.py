"""`mtaqueue-ctl dkim check DOMAIN`: for each key that signs DOMAIN's mail (its own, or
its nearest parent's), the TXT record to publish and what the DNS publishes now, asked
through the configured resolver. Computed from the config and the key files: no daemon
needed, but the key files must be readable."""

from __future__ import annotations

from typing import Any

from ..config import Config, parse_nameserver
from ..dkim.keys import load_keys
from ..dkim.published import LookupFailed, lookup, txt_strings, verdict, zone_line


class NoKey(Exception):
    """No [dkim] key signs mail from the domain."""


def check_domain(cfg: Config, domain: str) -> list[dict[str, Any]]:
    """One row per key; raises ConfigError (a key file) or NoKey."""
    keys = load_keys(cfg.dkim)
    signing = domain.lower().rstrip(".")
    while signing and signing not in keys:
        signing = signing.partition(".")[2]
    if not signing:
        known = ", ".join(keys) or "none"
        raise NoKey(f"no [dkim] key signs mail from {domain} (keys for: {known})")
    nameservers = [parse_nameserver(n) for n in cfg.dns.nameservers]
    rows = []
    for key in keys[signing]:
        try:
            status, detail = verdict(key, lookup(key.record_name, nameservers, cfg.dns.timeout))
        except LookupFailed as exc:
            status, detail = "error", f"{key.record_name}: no answer from the DNS: {exc}"
        rows.append(
            {
                "domain": key.domain,
                "selector": key.selector,
                "algorithm": key.algorithm,
                "key_file": key.key_file,
                "name": key.record_name,
                "record": key.record(),
                "txt": txt_strings(key.record()),
                "zone_line": zone_line(key),
                "status": status,
                "detail": detail,
            }
        )
    return rows


def show(rows: list[dict[str, Any]], out) -> None:
    for row in rows:
        out.write(f"{row['domain']}: selector {row['selector']}, {row['algorithm']}, ")
        out.write(f"key {row['key_file']}\n  publish:   {row['zone_line']}\n")
        out.write(f"  published: {row['status']}: {row['detail']}\n")
