"""The vocabulary of a verdict on a reply: outcomes, scopes, kinds, and `Verdict`.

    DELIVERED TRANSIENT PERMANENT AMBIGUOUS          outcomes
    RECIPIENT MESSAGE HOST DESTINATION               scopes: whom it concerns
    OK GREYLISTING THROTTLING ... BLOCKLIST IPV6 OTHER   kinds: why (KINDS, RULE_KINDS)
    ABOUT_US, REFUSES_SOURCE                         kinds that concern our sending
    Verdict(outcome, scope, kind, retry_after, suppress, status)

policy/classify.py says which a reply gets; this file only names them.
"""

from __future__ import annotations

import msgspec

# Outcomes.
DELIVERED = "delivered"
TRANSIENT = "transient"
PERMANENT = "permanent"
AMBIGUOUS = "ambiguous"

# Scopes.
RECIPIENT = "recipient"
MESSAGE = "message"
HOST = "host"
DESTINATION = "destination"

# Kinds.
OK = "ok"
GREYLISTING = "greylisting"
THROTTLING = "throttling"
MAILBOX = "mailbox"
MAILBOX_FULL = "mailbox_full"
POLICY = "policy"
CONTENT = "content"
SIZE = "size"
TOO_MANY_RECIPIENTS = "too_many_recipients"
NETWORK = "network"
DNS = "dns"
PROTOCOL = "protocol"
TLS = "tls"
AUTH = "auth"
BLOCKLIST = "blocklist"
REPUTATION = "reputation"  # the site refuses our IP or domain: its reputation, PTR, IP type
SENDER_AUTH = "sender_auth"  # SPF, DKIM or DMARC failed, or the mail is unauthenticated
IPV6 = "ipv6"
OTHER = "other"
# AMBIGUOUS is also a kind: a lost final reply taken as delivered (see classify).
KINDS = (
    OK,
    GREYLISTING,
    THROTTLING,
    MAILBOX,
    MAILBOX_FULL,
    POLICY,
    CONTENT,
    SIZE,
    TOO_MANY_RECIPIENTS,
    NETWORK,
    DNS,
    PROTOCOL,
    TLS,
    AUTH,
    BLOCKLIST,
    REPUTATION,
    SENDER_AUTH,
    IPV6,
    OTHER,
    AMBIGUOUS,
)
RULE_KINDS = KINDS[1:-1]  # a site rule classifies a failure: not "ok", not "ambiguous"
# About us, not the message or the recipient: our address on a list, our IP's or domain's
# reputation, our SPF/DKIM/DMARC. The mail stays ours (classes' on_sender_block).
ABOUT_US = frozenset({BLOCKLIST, REPUTATION, SENDER_AUTH})
# Of those, the site refusing our source address itself: that source pauses there. (Failed
# SPF/DKIM/DMARC follow the message's From domain: other senders' mail still goes.)
REFUSES_SOURCE = frozenset({BLOCKLIST, REPUTATION})


class Verdict(msgspec.Struct, frozen=True):
    outcome: str
    scope: str
    kind: str
    retry_after: float | None = None  # seconds, from a server hint ("try again in 5 minutes")
    suppress: bool = False  # hard bounce of a bad mailbox: suppress the address
    status: str = ""  # enhanced status for a DSN, its class agreeing with the outcome
