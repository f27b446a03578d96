"""What a delivery attempt got back: an SMTP reply, or a network event where none came.

The SMTP client turns every step of a conversation into a `Reply`; the policy
classifies it (`classify.py`) and the queue records `Reply.line()` as the
recipient's last reply and as the DSN's Diagnostic-Code.
"""

from __future__ import annotations

import re

import msgspec

# Phases of an SMTP client conversation, in order. "dns" is the next-hop lookup, "auth" our
# client AUTH at a smarthost, "data" waits for the 354, "data_end" for the reply after the
# final dot.
PHASES = (
    "dns",
    "connect",
    "banner",
    "ehlo",
    "starttls",
    "auth",
    "mail",
    "rcpt",
    "data",
    "data_end",
)

# What happened instead of a reply (code 0). "lost" is a connection closed or reset,
# "dns" a failed lookup of the next hop, "protocol" something that is no SMTP reply
# (garbage, an over-long line), "local" a failure on our side (not the server's doing),
# "auth" a smarthost that offers no AUTH mechanism we can use (PLAIN, LOGIN).
NETWORK_EVENTS = (
    "refused",
    "timeout",
    "lost",
    "unreachable",
    "tls",
    "dns",
    "protocol",
    "local",
    "auth",
)

# The codes that complete each step (RFC 5321 4.2.1, 4.3.2), a 2xx after the final dot being
# the only one that means delivered. Any other code that is not a 4xx/5xx refusal (a 250
# greeting, 252 to MAIL, 250 to DATA) says the server is out of step with us.
COMPLETES = {
    "banner": frozenset({220}),
    "ehlo": frozenset({250}),
    "starttls": frozenset({220}),
    "auth": frozenset({235}),
    "mail": frozenset({250}),
    "rcpt": frozenset({250, 251}),
    "data": frozenset({354}),
    "data_end": frozenset(range(200, 300)),
}

# RFC 3463 class.subject.detail; the class must agree with the reply code's first
# digit (RFC 2034 section 3), otherwise it is just text.
_ENHANCED = re.compile(r"([245])\.[0-9]{1,3}\.[0-9]{1,3}(?=\s|$)")

_EVENTS = {
    "refused": "connection refused",
    "timeout": "timeout",
    "lost": "connection lost",
    "unreachable": "host unreachable",
    "tls": "TLS failure",
    "dns": "DNS failure",
    "protocol": "unreadable reply",
    "local": "local error",
    "auth": "no usable AUTH mechanism",
}
_WHILE = {
    "dns": "while looking up the next hop",
    "connect": "while connecting",
    "banner": "while waiting for the 220 greeting",
    "ehlo": "while waiting for the reply to EHLO",
    "starttls": "during STARTTLS",
    "auth": "while authenticating",
    "mail": "while waiting for the reply to MAIL FROM",
    "rcpt": "while waiting for the reply to RCPT TO",
    "data": "while waiting for the reply to DATA",
    "data_end": "after the end of data (the message may have been delivered)",
}


class Reply(msgspec.Struct, frozen=True):
    phase: str
    code: int  # SMTP reply code; 0 when there was no reply (a network event)
    enhanced: str = ""  # "5.1.1" when the reply carried one, else ""
    text: str = ""  # reply text (multi-line joined with " / "), or a description of the event
    network: str = ""  # for code 0: one of NETWORK_EVENTS

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}")
        if (self.code == 0) != bool(self.network):
            raise ValueError("a network event has code 0 and a reply has no network event")
        if self.network and self.network not in NETWORK_EVENTS:
            raise ValueError(f"unknown network event {self.network!r}")
        if self.enhanced and not _ENHANCED.fullmatch(self.enhanced):
            raise ValueError(f"not an enhanced status code: {self.enhanced!r}")

    @classmethod
    def parse(cls, phase: str, code: int, message: str) -> Reply:
        """A reply from its code and message (as aiosmtplib gives them: one line per reply
        line, codes stripped). A leading enhanced code is split off; servers that repeat it
        on every line (Gmail) get it removed from each."""
        lines = [line.strip() for line in message.splitlines()]
        enhanced = ""
        m = _ENHANCED.match(lines[0]) if lines else None
        if m and int(m[1]) == code // 100:
            enhanced = m[0]
            lines = [_unrepeated(line, enhanced) for line in lines]
        return cls(phase, code, enhanced, " / ".join(line for line in lines if line))

    def line(self) -> str:
        """One line for logs, last_reply and DSNs: "550 5.1.1 text". A network event has
        no code: "[enhanced] description", the description being the client's text, else
        e.g. "timeout while waiting for the 220 greeting"."""
        if self.code == 0:
            text = self.text or f"{_EVENTS[self.network]} {_WHILE[self.phase]}"
            return f"{self.enhanced} {text}" if self.enhanced else text
        return " ".join(part for part in (str(self.code), self.enhanced, self.text) if part)


def _unrepeated(line: str, enhanced: str) -> str:
    """`line` without a leading `enhanced` code standing as a word of its own."""
    if not line.startswith(enhanced):
        return line
    rest = line[len(enhanced) :]
    return line if rest and not rest[0].isspace() else rest.lstrip()
