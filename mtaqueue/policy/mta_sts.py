"""MTA-STS (RFC 8461), sans-IO: the TXT record, the policy file, MX matching, the cache.

The I/O (the TXT lookup through the daemon's resolver, the HTTPS fetch, the state file) is
delivery/mta_sts.py's; this module only parses and decides, with `now` passed in.

What the cache decides (RFC 8461 3.3 and 5.1): a cached policy is used until its max_age
has passed; a TXT id other than the cached policy's asks for a fetch; a failed fetch (or
no TXT record, or a DNS failure) keeps a cached policy that has not expired, since an
attacker who can block the TXT lookup or the HTTPS fetch must not be able to turn
enforcement off. Without a valid policy the domain is delivered to as if it had none.
"""

from __future__ import annotations

import re

import msgspec

from ..routing.sts import Applied

ENFORCE = "enforce"
TESTING = "testing"
NONE = "none"
MODES = (ENFORCE, TESTING, NONE)
MAX_AGE_LIMIT = 31_557_600  # RFC 8461 3.2: at most one year
POLICY_SIZE_LIMIT = 64 * 1024  # RFC 8461 3.3: senders may refuse larger policies
WELL_KNOWN = "/.well-known/mta-sts.txt"

_ID = re.compile(r"[A-Za-z0-9]{1,32}\Z")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")


class Policy(msgspec.Struct, frozen=True):
    """A fetched policy, as cached (and stored in the state file)."""

    id: str  # the TXT record's id when it was fetched
    mode: str  # ENFORCE, TESTING or NONE
    mx: tuple[str, ...]  # lower-case patterns: "mx.example.org" or "*.example.org"
    max_age: int  # seconds
    fetched: float  # epoch seconds

    def expired(self, now: float) -> bool:
        return now >= self.fetched + self.max_age


def parse_record(texts: list[str]) -> str | None:
    """The policy id of a domain's `_mta-sts` TXT records (each already joined from its
    strings); None: no MTA-STS. RFC 8461 3.1: only records that begin with "v=STSv1"
    count, and more than one of them is as none."""
    records = [t for t in texts if t.startswith("v=STSv1")]
    if len(records) != 1:
        return None
    fields = [f.strip() for f in records[0].split(";")]
    if fields and not fields[-1]:
        fields.pop()  # the optional trailing ";"
    values: dict[str, str] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        if not sep:
            return None
        values.setdefault(key.strip(), value.strip())
    if fields[0].replace(" ", "") != "v=STSv1":
        return None
    ident = values.get("id", "")
    return ident if _ID.match(ident) else None


def parse_policy(text: str, ident: str, now: float) -> Policy | str:
    """The policy file (RFC 8461 3.2: "key: value" lines ending in CRLF or LF, unknown
    keys ignored, "mx" repeated), or why it is refused."""
    values: dict[str, str] = {}
    mx: list[str] = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            continue  # a blank line, or none of ours
        if key == "mx":
            mx.append(value.lower().removesuffix("."))
        else:
            values.setdefault(key, value)  # the first of a key repeated counts
    if values.get("version") != "STSv1":
        return "version is not STSv1"
    mode = values.get("mode", "")
    if mode not in MODES:
        return f"mode {mode!r} is not enforce, testing or none"
    age = values.get("max_age", "")
    if not (age.isascii() and age.isdigit() and len(age) <= 10):
        return f"max_age {age!r} is not a number of seconds"
    bad = next((p for p in mx if not _pattern(p)), None)
    if bad is not None:
        return f"mx {bad!r} is not a host name pattern"
    if not mx and mode != NONE:
        return "no mx patterns"
    return Policy(ident, mode, tuple(mx), min(int(age), MAX_AGE_LIMIT), now)


def _pattern(text: str) -> bool:
    """A host name, or "*." and a host name."""
    labels = text.removeprefix("*.").split(".")
    return len(text) <= 253 and all(_LABEL.match(label) for label in labels)


def render_policy(policy: Policy) -> str:
    """The policy as a file (the inverse of parse_policy; tests and docs)."""
    lines = ["version: STSv1", f"mode: {policy.mode}"]
    lines += [f"mx: {pattern}" for pattern in policy.mx]
    lines.append(f"max_age: {policy.max_age}")
    return "\r\n".join(lines) + "\r\n"


def mx_matches(host: str, patterns: tuple[str, ...]) -> bool:
    """RFC 8461 4.1: the MX name equals a pattern, or a "*." pattern with exactly one
    more label on the left; case-insensitive, trailing dot ignored."""
    host = host.lower().removesuffix(".")
    label, _, parent = host.partition(".")
    return any(host == p or (p.startswith("*.") and label and parent == p[2:]) for p in patterns)


# -- the cache ------------------------------------------------------------------------------


class Fetch(msgspec.Struct, frozen=True):
    """Fetch the policy now (its TXT id is new, or no valid policy is cached)."""

    id: str


def plan(cached: Policy | None, record_id: str | None, now: float) -> Policy | Fetch | None:
    """What a delivery to a domain goes by, from its cached policy and its TXT record's id
    (None: no record, or the lookup failed). A Fetch asks for the HTTPS GET; None: no
    MTA-STS for this delivery."""
    valid = cached if cached is not None and not cached.expired(now) else None
    if record_id is None:
        return valid  # RFC 8461 5.1: a cached policy outlives a missing (blocked) TXT
    if valid is not None and valid.id == record_id:
        return valid
    return Fetch(record_id)


def after_fetch(cached: Policy | None, fetched: Policy | None, now: float) -> Policy | None:
    """What a fetch leaves in the cache: the new policy, or (a failed fetch) a cached
    policy that is still valid, else nothing."""
    if fetched is not None:
        return fetched
    return cached if cached is not None and not cached.expired(now) else None


# -- what a connection to one MX host needs ------------------------------------------------

VERIFY = "verify"  # TLS with a certificate valid for the MX name, or no delivery
VERIFY_OR_LOG = "verify-or-log"  # try that; a failure is logged, delivery goes on as usual
AS_USUAL = ""  # delivery.tls as configured


def eligible(applied: Applied, hosts: list[str]) -> tuple[list[str], list[str]]:
    """The MX hosts delivery may use, and those the policy does not list: in enforce
    mode the unlisted are left out (RFC 8461 4.1), in testing they stay, to be logged."""
    unlisted = [h for h in hosts if not mx_matches(h, applied.mx)]
    if applied.mode == ENFORCE:
        return [h for h in hosts if h not in unlisted], unlisted
    return hosts, unlisted


def requirement(applied: Applied | None, host: str) -> str:
    """What a connection to `host` needs: VERIFY, VERIFY_OR_LOG or AS_USUAL."""
    if applied is None:
        return AS_USUAL
    if applied.mode == ENFORCE:
        return VERIFY
    return VERIFY_OR_LOG if mx_matches(host, applied.mx) else AS_USUAL
