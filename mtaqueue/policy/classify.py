"""Classify a reply (or a network event) into a `Verdict`: what happened, whom it concerns,
and why.

Outcome: "delivered", "transient" (retry later), "permanent" (bounce), or "ambiguous": no
reply came after the final dot, so the message may or may not have arrived. With
`delivery.ambiguous = "retry"` that is the outcome (retried, at the risk of a duplicate);
with "assume-delivered" the outcome is "delivered" and the kind "ambiguous" (a possible loss
that logs and metrics can still tell from a real 250).

Scope, whom the verdict concerns:
- "recipient": this recipient only (a RCPT reply);
- "message": every recipient of the transaction (MAIL, DATA, end of data; RFC 5321 3.8
  treats a connection lost mid-transaction as a 451 for all of them);
- "host": the MX host failed before a transaction: suspend it and try the next MX;
- "destination": the whole destination (its MX set, its domain) is deferring us: pace it.

Kind says why, for pacing and for people: greylisting wants a patient second attempt of
that recipient; throttling wants the destination slowed down (retrying sooner or later does
not help); "mailbox" with `suppress` is a hard bounce that goes on the suppression list;
"auth" is a smarthost refusing our client AUTH (or asking for one, or for TLS first): our
configuration's problem, never the message's, so it defers and stops the destination.

Precedence: a 2xx after the final dot (or 250/251 to RCPT) is a success, and nothing else
is; then no usable reply after the dot is ambiguous; then the site's rules
(`delivery.rules`, first match); then the next-hop lookup, network events, replies out of
step, and the built-in table (policy/reply_table.py, first match); then the reply's class
digit (4 transient, 5 permanent; RFC 3463 says to honour the class even when the subject
or detail is unknown).

A reply out of step (`replies.COMPLETES`: a 250 greeting, 252 to MAIL, 250 to DATA, 354 to
RCPT, a code of no class) or no SMTP reply at all ("protocol") is a protocol error: the
host's, transient, and its session is not to be trusted further. Our own failure ("local")
is the message's, transient: no host is suspended for our bug.

In short, the table says:
- greylisting words ("greylisted", "graylist", "postgrey") in a 4xx: greylisting, recipient;
- a 5xx naming a listed domain in the message (Spamhaus DBL, SURBL, URIBL): content;
- about our source, in any phase, 4xx or 5xx: transient, destination, never a bounce nor a
  suppression (`verdict.ABOUT_US`; another source, a delisting or a fix of ours cures it):
  - blocklist: our address on a DNSBL or the site's own list ("blocked using", "listed at",
    Yahoo BL2x, Microsoft "banned sending IP", Comcast BL000xxx, T-Online "(BL)", Postfix's
    "Client host rejected" with a x.7.x or no code: an access map, "Access denied");
  - sender_auth (not at AUTH): SPF, DKIM, DMARC, "unauthenticated", anti-spoofing; codes
    x.7.23, x.7.26, x.7.27, 5.7.509, 5.7.515, and Yahoo's x.7.9 after the data;
  - reputation (after the 4xx rate limits below): poor or low reputation, "not accepted from
    this IP", PTR/rDNS, dial-up or dynamic addresses, Microsoft 5.7.501-503, 5.7.6xx, 5.7.705,
    5.7.708, 5.7.750, and x.7.25;
- "IPv6" with "PTR"/"guidelines" (Gmail's 550-5.7.1): ipv6, transient, destination (the
  site wants us over IPv4: the recipient goes again over IPv4);
- 4xx with 4.7.28, Microsoft 4.7.5xx/6xx, Yahoo TSxx, "rate limited", "too many
  connections", concurrency caps, "server busy"...: throttling, destination (Yahoo TS03 with
  a 4 h wait); Gmail's 450 4.2.1 "receiving mail too quickly" is one mailbox's limit:
  recipient; QQ's 550 "frequency limited": throttling too, transient;
- "try again later" with a 4xx and no or a 4.7.0/4.7.1 code outside RCPT: throttling,
  destination (even in a 421);
- 421 at any phase: the site closed the session: destination (throttling if 4.7.x), but
  Postfix's "too many errors" (its error tarpit) is the session's, message;
- Postfix's anvil ("too much mail from", "too many recipients from", "too many
  connections from"): throttling, destination;
- "try again later" at RCPT with 450/451 and no or a 4.7.0/4.7.1/4.2.0 code: greylisting,
  unless it names a problem or error of the server's own;
- 530 at any phase (RFC 4954 "authentication required", RFC 3207 "must issue a STARTTLS
  command first") and any 5xx to our AUTH (535 5.7.8 bad credentials, 534, 538, 504) or a
  smarthost with no mechanism we can use: auth, transient, destination (a config error of
  ours: it must not bounce mail);
- any failure at connect/greeting/EHLO/STARTTLS/AUTH: transient, host (try the next MX;
  Postfix treats a 5xx greeting the same way);
- at RCPT: x.5.3, 452, or "too many recipients" (a 552 too): too_many_recipients,
  transient (RFC 5321 4.5.3.1.10); x.2.2, 552 or "mailbox full": mailbox_full, transient
  (RFC 3463: "persistent transient"); 5.1.0/1/2/3/6/10, 5.2.1 (disabled), or a 5xx whose
  words say no such or a disabled mailbox whatever its code (5.5.0, 5.0.0, 5.7.1), or a 550
  "mailbox unavailable" with no telling code and no word of refusal: mailbox, suppressed;
- x.3.4/x.2.3 or a 552 at MAIL/DATA: size; x.6.x, content words after the data, or a 554
  after the data: content; x.7.x: policy; 500-504, 555, x.5.x: protocol; a 5xx to MAIL:
  policy.

Verdict.status is the reply's enhanced code, else one derived from the kind; its class
always agrees with the outcome (a transient 552 5.2.2 reports 4.2.2), as DSNs need.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from .. import config
from .replies import COMPLETES, PHASES, Reply
from .reply_table import TABLE
from .verdict import (
    ABOUT_US,
    AMBIGUOUS,
    AUTH,
    DELIVERED,
    DESTINATION,
    DNS,
    HOST,
    MAILBOX,
    MAILBOX_FULL,
    MESSAGE,
    NETWORK,
    OK,
    OTHER,
    PERMANENT,
    PROTOCOL,
    RECIPIENT,
    RULE_KINDS,
    SIZE,
    THROTTLING,
    TLS,
    TOO_MANY_RECIPIENTS,
    TRANSIENT,
    Verdict,
)


class Rule(msgspec.Struct, frozen=True):
    """A compiled site rule (`delivery.rules`)."""

    pattern: re.Pattern[str]
    outcome: str
    kind: str
    phase: str = ""


def compile_rules(rules: Sequence[config.ReplyRule]) -> tuple[Rule, ...]:
    """Site rules, ready for classify. Patterns ignore case: servers do not agree on it and
    change it over time ("(?-i:...)" turns that off). Raises ConfigError naming the rule."""
    compiled = []
    for i, rule in enumerate(rules):
        where = f"delivery.rules[{i}]"
        if rule.phase and rule.phase not in PHASES:
            expected = ", ".join(PHASES)
            raise config.ConfigError(
                f"{where}.phase: unknown phase {rule.phase!r} (expected one of {expected})"
            )
        if rule.kind not in RULE_KINDS:
            expected = ", ".join(RULE_KINDS)
            raise config.ConfigError(
                f"{where}.kind: unknown kind {rule.kind!r} (expected one of {expected})"
            )
        try:
            pattern = re.compile(rule.match, re.IGNORECASE)
        except re.error as exc:
            raise config.ConfigError(f"{where}.match: invalid regex: {exc}") from None
        compiled.append(Rule(pattern, rule.outcome, rule.kind, rule.phase))
    return tuple(compiled)


def classify(
    reply: Reply, rules: Sequence[Rule] = (), *, ambiguous_policy: str = "retry"
) -> Verdict:
    """The verdict on one reply; `ambiguous_policy` is `delivery.ambiguous`."""
    klass = reply.code // 100
    if reply.phase in ("rcpt", "data_end") and reply.code in COMPLETES[reply.phase]:
        return _verdict(reply, DELIVERED, OK)
    if reply.phase == "data_end" and klass not in (4, 5):
        # No reply after the final dot, or one that means nothing there (garbage, 354):
        # the server may have the message. Checked before the site rules: choosing between
        # a duplicate and a loss is delivery.ambiguous's job, not a regex's.
        return _ambiguous(ambiguous_policy)
    for rule in rules:
        if rule.phase in ("", reply.phase) and rule.pattern.search(reply.line()):
            return _verdict(
                reply,
                rule.outcome,
                rule.kind,
                scope=DESTINATION if rule.kind in _DESTINATION_KINDS else "",
                suppress=rule.kind == MAILBOX and reply.phase == "rcpt",
            )
    if reply.phase == "dns" and reply.network != "tls":  # tls: MTA-STS, no MX listed
        return _dns(reply)
    if reply.code == 0:
        return _network(reply)
    if klass not in (4, 5):
        # Out of step: a 2xx/3xx where it does not belong, or no valid code. Its enhanced
        # code (2.1.0 with a 252) says nothing about this failure.
        out_of_step = msgspec.structs.replace(reply, enhanced="")
        return _verdict(out_of_step, TRANSIENT, PROTOCOL, scope=HOST)
    key = f"{reply.phase} {reply.code} {reply.enhanced or '-'}"
    for row in TABLE:
        if row.key.fullmatch(key) and (row.text is None or row.text.search(reply.text)):
            return _verdict(
                reply,
                row.outcome or _by_class(klass),
                row.kind,
                scope=row.scope,
                suppress=row.suppress,
                retry_after=row.retry_after,
            )
    return _verdict(reply, _by_class(klass), OTHER)


# -- everything that is not a plain reply ------------------------------------------------


def _ambiguous(policy: str) -> Verdict:
    """No reply after the final dot. "retry" risks a duplicate; "assume-delivered" risks a
    loss and says so in its kind, so logs and metrics still tell it from a real 250."""
    if policy == "retry":
        return Verdict(AMBIGUOUS, MESSAGE, NETWORK, status="4.4.2")
    if policy == "assume-delivered":
        return Verdict(DELIVERED, MESSAGE, AMBIGUOUS, status="2.0.0")
    raise ValueError(f"unknown ambiguous policy {policy!r}")


def _dns(reply: Reply) -> Verdict:
    """The next-hop lookup failed; the resolver's enhanced code says how (5.1.2 NXDOMAIN,
    5.1.10 null MX, 5.4.4 no address, 4.4.3 a failure to retry)."""
    klass = reply.code // 100 if reply.code else int(reply.enhanced[:1] or 4)
    outcome = _by_class(klass)
    # No such domain and a null MX are final for the address; 5.4.4 may be their broken DNS.
    bad_address = reply.enhanced[1:4] == ".1."
    return _verdict(reply, outcome, DNS, suppress=bad_address, detail="4.3")


def _network(reply: Reply) -> Verdict:
    """No reply (refused, timeout, lost, TLS). Before MAIL it is the host's problem: try the
    next MX; during a transaction RFC 5321 3.8 says to take it as a 451 for all of it.
    Garbage is the host's at any phase; a local error is never the host's. A smarthost
    that offers no AUTH mechanism we can use is our configuration's problem."""
    if reply.network == "auth":
        return _verdict(reply, TRANSIENT, AUTH, scope=DESTINATION)
    if reply.network == "protocol":
        return _verdict(reply, TRANSIENT, PROTOCOL, scope=HOST)
    if reply.network == "local":
        return _verdict(reply, TRANSIENT, OTHER, scope=MESSAGE, detail="3.0")
    setup = PHASES.index(reply.phase) < PHASES.index("mail")
    outcome = PERMANENT if reply.enhanced.startswith("5") else TRANSIENT
    if reply.network == "tls" and setup:
        return _verdict(reply, outcome, TLS)
    # RFC 3463: 4.4.1 no answer from host, 4.4.2 bad connection.
    detail = "4.1" if reply.phase == "connect" else "4.2"
    return _verdict(reply, outcome, NETWORK, scope="" if setup else MESSAGE, detail=detail)


# -- assembling a verdict -------------------------------------------------------------------

_PHASE_SCOPE = {
    "dns": DESTINATION,
    "connect": HOST,
    "banner": HOST,
    "ehlo": HOST,
    "starttls": HOST,
    "auth": HOST,
    "mail": MESSAGE,
    "rcpt": RECIPIENT,
    "data": MESSAGE,
    "data_end": MESSAGE,
}
# A site rule of these kinds speaks of the whole destination, as the table's rows do.
_DESTINATION_KINDS = ABOUT_US | {THROTTLING}
_STATUS_CLASS = {DELIVERED: "2", TRANSIENT: "4", AMBIGUOUS: "4", PERMANENT: "5"}
# Subject.detail for a reply without an enhanced code.
_DETAIL = {
    MAILBOX: "1.1",
    MAILBOX_FULL: "2.2",
    SIZE: "3.4",
    TOO_MANY_RECIPIENTS: "5.3",
    PROTOCOL: "5.0",
    TLS: "7.5",
    AUTH: "7.0",
}


def _by_class(klass: int) -> str:
    return PERMANENT if klass == 5 else TRANSIENT


def _verdict(
    reply: Reply,
    outcome: str,
    kind: str,
    *,
    scope: str = "",
    suppress: bool = False,
    retry_after: float | None = None,
    detail: str = "",
) -> Verdict:
    if not scope:
        scope = _PHASE_SCOPE[reply.phase]
        if scope == HOST and outcome == PERMANENT:
            scope = MESSAGE  # "try the next MX" means nothing for a bounce (site rules only)
    if outcome == TRANSIENT:
        hint = _hint(reply.text)
        retry_after = hint if hint is not None else retry_after
    else:
        retry_after = None
    detail = reply.enhanced[2:] or detail or _DETAIL.get(kind, "0.0")
    status = f"{_STATUS_CLASS[outcome]}.{detail}"
    return Verdict(outcome, scope, kind, retry_after, suppress and outcome == PERMANENT, status)


# "try again in 5 minutes", "retry in 300 seconds", "come back in 1 hour", "wait 60s",
# "greylisted for 300 seconds", milter-greylist's "come back in 00:04:57".
_HINT = re.compile(
    r"(?:\b(?:again|retry|back|wait|resend)|listed|deferred|delayed)\s+(?:(?:in|after|for)\s+)?"
    r"(?:([0-9]{1,2}):([0-9]{2}):([0-9]{2})\b"
    r"|([0-9]+(?:\.[0-9]+)?)\s*(s|secs?|seconds?|m|mins?|minutes?|h|hrs?|hours?)\b)",
    re.IGNORECASE,
)
_UNIT = {"s": 1, "m": 60, "h": 3600}
# A hint is believed up to a day: a wild one must not park mail past its lifetime (the
# look-ahead expiry would then bounce it at once).
MAX_HINT = 86400.0


def _hint(text: str) -> float | None:
    """Seconds the server asks us to wait, if its text says."""
    m = _HINT.search(text)
    if m is None:
        return None
    if m[1]:
        seconds = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
    else:
        seconds = float(m[4]) * _UNIT[m[5][0].lower()]
    return min(float(seconds), MAX_HINT)
