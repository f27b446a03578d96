"""What `mtaqueue-ctl dkim check DOMAIN` shows and checks: each key's TXT record, as a
zone file line to publish, and whether the DNS publishes that key.

`verdict()` is pure; `lookup()` asks the configured resolver (dns.nameservers).
"""

from __future__ import annotations

import base64
import binascii

import dns.exception
import dns.nameserver
import dns.resolver

from .keys import SigningKey

MAX_STRING = 255  # octets of one TXT character-string (RFC 1035 3.3)


def txt_strings(record: str) -> list[str]:
    """The record cut into the character-strings a TXT record holds (ASCII text)."""
    return [record[i : i + MAX_STRING] for i in range(0, len(record), MAX_STRING)] or [""]


def zone_line(key: SigningKey) -> str:
    """`selector._domainkey.domain. IN TXT "..." "..."`, as a zone file has it."""
    strings = " ".join(f'"{s}"' for s in txt_strings(key.record()))
    return f"{key.record_name}. IN TXT {strings}"


class LookupFailed(Exception):
    """The DNS gave no answer (a timeout, SERVFAIL...): nothing can be said."""


def lookup(name: str, nameservers: list[tuple[str, int]], timeout: float) -> list[str]:
    """The TXT records at `name` (each one's strings joined); [] when there is none."""
    resolver = dns.resolver.Resolver(configure=not nameservers)
    if nameservers:
        resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in nameservers]
    resolver.lifetime = timeout
    try:
        answer = resolver.resolve(name, "TXT", search=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return []
    except dns.exception.DNSException as exc:
        raise LookupFailed(str(exc) or type(exc).__name__) from None
    return [b"".join(rdata.strings).decode("utf-8", "replace") for rdata in answer]


def verdict(key: SigningKey, published: list[str]) -> tuple[str, str]:
    """("ok" | "missing" | "revoked" | "mismatch", what it means) for the key given the TXT
    records found at its name."""
    records = [tags(text) for text in published]
    records = [r for r in records if r.get("v", "DKIM1") == "DKIM1" and "p" in r]
    if not records:
        return "missing", f"no DKIM key record at {key.record_name}: publish the line above"
    if len(records) > 1:
        return "mismatch", f"{len(records)} key records at {key.record_name}: keep one"
    (record,) = records
    if not record["p"]:
        return "revoked", f"{key.record_name} publishes an empty p= (a revoked key)"
    if record.get("k", "rsa") != key.key_type:
        return "mismatch", f"{key.record_name} publishes a k={record.get('k', 'rsa')} key"
    try:
        public = base64.b64decode(record["p"], validate=True)
    except (binascii.Error, ValueError):
        return "mismatch", f"{key.record_name}: p= is not base64"
    if public != key.public_key():
        return "mismatch", f"{key.record_name} publishes another key than {key.key_file}"
    return "ok", f"{key.record_name} publishes this key"


def tags(text: str) -> dict[str, str]:
    """A tag=value list (RFC 6376 3.2); whitespace inside p= is dropped."""
    found = {}
    for item in text.split(";"):
        name, equals, value = item.partition("=")
        if equals:
            name = name.strip()
            found[name] = "".join(value.split()) if name == "p" else value.strip()
    return found
