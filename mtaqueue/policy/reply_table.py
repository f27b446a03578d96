"""The built-in table of replies as the world writes them: (phase, code, enhanced code,
text) -> kind, outcome, scope.

    TABLE: tuple[Row, ...]   first match wins (policy/classify.py reads it)
    Row(kind, key, text, outcome, scope, suppress, retry_after)

Rows are written with `_row`: codes and enhanced codes as globs ("45x", "x.7.28",
"4.7.5xx"), phases and alternatives separated by spaces, text as a case-blind regex.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from .verdict import (
    AUTH,
    BLOCKLIST,
    CONTENT,
    DESTINATION,
    GREYLISTING,
    IPV6,
    MAILBOX,
    MAILBOX_FULL,
    MESSAGE,
    OTHER,
    POLICY,
    PROTOCOL,
    REPUTATION,
    SENDER_AUTH,
    SIZE,
    THROTTLING,
    TLS,
    TOO_MANY_RECIPIENTS,
    TRANSIENT,
)


class Row(msgspec.Struct, frozen=True):
    kind: str
    key: re.Pattern[str]  # fullmatch on "PHASE CODE ENHANCED": "rcpt 550 5.1.1", "mail 451 -"
    text: re.Pattern[str] | None  # searched in the reply text
    outcome: str  # "" = by the class digit
    scope: str  # "" = by phase
    suppress: bool  # when the outcome is permanent
    retry_after: float | None  # when the text gives no hint


def _number(glob: str) -> str:
    # "x" alone is any number; inside a number each x is one digit ("45x", "5xx").
    return "[0-9]+" if glob == "x" else glob.replace("x", "[0-9]")


def _status_glob(glob: str) -> str:
    # "*" is anything, "-" no enhanced code, else dotted numbers: "x.7.28", "4.7.5xx".
    return r"\S+" if glob == "*" else r"\.".join(_number(part) for part in glob.split("."))


def _either(globs: str, convert: Callable[[str], str]) -> str:
    return "(?:" + "|".join(convert(glob) for glob in globs.split()) + ")"


def _row(
    kind: str,
    *,
    codes: str = "4xx 5xx",
    status: str = "*",
    text: str = "",
    phases: str = "",
    outcome: str = "",
    scope: str = "",
    suppress: bool = False,
    retry_after: float | None = None,
) -> Row:
    """A table row; every condition given must hold. Space-separated alternatives."""
    phase = _either(phases, re.escape) if phases else r"\S+"
    key = re.compile(f"{phase} {_either(codes, _number)} {_either(status, _status_glob)}")
    pattern = re.compile(text, re.IGNORECASE) if text else None
    return Row(kind, key, pattern, outcome, scope, suppress, retry_after)


_GENERIC = "- x.0.0"  # no enhanced code, or one that adds nothing to the class
_SETUP = "connect banner ehlo starttls auth"  # before a transaction: the host's business

_GREYLIST = r"gr[ae]y[ -]?list|postgrey"
# Postfix's anvil says "too much mail from ADDR" (message rate), "too many recipients from
# ADDR" (recipient rate: not RFC 5321's per-transaction limit, which names no client) and
# "too many connections from ADDR" (count or rate). Caps on connections or on messages per
# session, QQ's "frequency limited" and Microsoft's RP-00x hourly limits pace us too.
_THROTTLE = (
    r"rate[ -]?limit|too many (?!recipients|errors)|too many recipients (?:from|received)"
    r"|too much mail|sending rate|unusual rate|too (?:fast|quickly)|frequency limit"
    r"|throttl|(?:server|too) busy|unexpected volume|excessive (?:volume|traffic)"
    r"|\bTSS?[0-9]{2}\b|\bRP-00[0-9]\b|concurren(?:t|cy)|max\w* messages? per"
)
_TRY_LATER = r"\b(?:(?:try|retry|come back) (?:again )?later|(?:try again|retry|come back) in\b)"
# A "try later" that names a fault of the server's own is no greylisting (Exim's "451
# Temporary local problem - please try later").
_OWN_FAULT = r"(?s)\A(?!.*\b(?:problem|error|resources?)\b).*?"
_MAILBOX_FULL = r"mailbox (?:is )?full|over ?quota|quota (?:exceeded|full|limit)|storage allocation"
# Words that only a missing or closed mailbox earns, whatever enhanced code comes with them
# (Outlook.com 5.5.0, Yandex 5.7.1, Sendmail 5.0.0, Exim none).
_NO_SUCH_USER = (
    r"user unknown|unknown (?:user|recipient|mailbox)|no such (?:user|mailbox|recipient|address)"
    r"|does ?n[o']t exist|(?:mailbox|recipient|user) not found|recip(?:ient)?notfound"
    r"|invalid (?:recipient|mailbox)|unrouteable address|no mailbox here|#5\.1\.[01] address"
    r"|does ?n[o']t have an? \S+ account|(?:account|mailbox) (?:is )?(?:disabled|inactive)"
)
# RFC 5321's own words for 450/550 ("Requested action not taken: mailbox unavailable"):
# a missing mailbox at Outlook.com, GMX or in a bare 550, but some sites send them for a
# policy refusal, so they count only at 550 with no telling enhanced code and no word of
# refusal (QQ's "Mailbox unavailable or access denied" is a per-recipient rate limit).
_UNAVAILABLE = r"mailbox (?:is )?(?:unavailable|not available)"
_REFUSAL = r"(?s)\A(?!.*(?:denied|polic|spam|block|reputation|relay|limit)).*?"
# Our client address on a DNSBL or the site's own list ("blocked using zen.spamhaus.org",
# Yahoo's "[BL21] ... in Spamhaus's list", Microsoft's "5.7.606 banned sending IP", Comcast's
# BL000xxx, T-Online's "(BL)", Proofpoint's ipcheck page).
_BLOCKLIST = (
    r"block ?list|black ?list|\bblocked using\b|\b(?:spamhaus|spamcop|barracuda|sorbs|uceprotect)"
    r"|\b(?:DNSBL|RBL)s?\b|\blisted (?:at|on|in|by)\b|banned sending ip|\bBL2[0-9]\b"
    r"|\bBL0{2,3}[01]{3}\b|\(BL\)|ipcheck\.proofpoint"
)
# A blocklist that lists a domain found in the message (a link), not our address.
_LISTED_CONTENT = r"\bDBL\b|\bSURBL\b|\bURIBL\b|domain present in"
# The site refuses our IP or domain on its own judgement: reputation, a missing or generic
# PTR, an address that looks dynamic, our tenant or account flagged for spam.
_REPUTATION = (
    r"\b(?:poor|low|bad)\s+(?:\w+\s+){0,2}reputation|reputation of the sending"
    r"|\bnot accepted from (?:this|your) (?:ip|host|network)|from your ip(?: address)? has been"
    r"|\bPTR\b|reverse (?:dns|hostname)|\brDNS\b|cannot find your (?:reverse )?hostname"
    r"|dial-?up|dynamic/residential|transient ip|tenant has exceeded|spam abuse detected"
    r"|unregistered domain|suspected spam sender|blocked by spam statistics"
)
# Authentication of our mail failed, or the site wants some: SPF, DKIM, DMARC, spoofing.
_SENDER_AUTH = (
    r"\b(?:SPF|DKIM|DMARC)\b|unauthenticated|authentication (?:checks?|information|level)"
    r"|sender policy framework|anti-?spoofing"
)
_NOT_AUTH_PHASES = "connect banner ehlo mail rcpt data data_end"  # AUTH replies are ours
# Gmail: "550-5.7.1 ... does not meet IPv6 sending guidelines regarding PTR records and
# authentication": our IPv6 address lacks what it wants; IPv4 would do.
_IPV6 = (
    r"(?s)\bIPv6\b.*\b(?:PTR|reverse|guidelines)\b|\b(?:PTR|reverse dns)\b.*\bIPv6\b"
    r"|\bIPv6AuthError\b"
)
_OURS = {"outcome": TRANSIENT, "scope": DESTINATION}
# Yahoo TS03 ("permanently deferred, retrying will NOT succeed") comes as a 4xx: the mail
# stays ours, so keep it, but do not knock again for hours; expiry ends it if nothing changes.
_TS03_WAIT = 4 * 3600.0

TABLE = (
    # Greylisting says so; nothing else uses those words, so they come first.
    _row(GREYLISTING, codes="4xx", text=_GREYLIST),
    # A domain of the message's links on a list: the content's fault, not our address's.
    _row(CONTENT, codes="5xx", text=_LISTED_CONTENT),
    # About our source, not the message or the recipient, at any phase and in a 4xx or a
    # 5xx: deferred for the destination, never bounced (another source of its pool takes
    # it, or it waits for the delisting or the fix until its lifetime).
    _row(BLOCKLIST, text=_BLOCKLIST, outcome=TRANSIENT, scope=DESTINATION),
    _row(IPV6, text=_IPV6, outcome=TRANSIENT, scope=DESTINATION),
    # Gmail 5.7.26/4.7.26 and x.7.27, Microsoft 5.7.23 (SPF), 5.7.509 (DMARC), 5.7.515; Yahoo
    # says 5.7.9 after the data for a DMARC or SPF failure (RFC 4954's 5.7.9 is for AUTH).
    _row(SENDER_AUTH, text=_SENDER_AUTH, phases=_NOT_AUTH_PHASES, **_OURS),
    _row(
        SENDER_AUTH,
        status="x.7.9 x.7.23 x.7.26 x.7.27 5.7.509 5.7.515",
        phases=_NOT_AUTH_PHASES,
        **_OURS,
    ),
    # Throttling: pace the destination. Gmail's 4.2.1 "receiving mail too quickly" limits
    # one mailbox, though: that stays with the recipient.
    _row(THROTTLING, codes="4xx", status="x.2.1", text=r"too quickly|at a rate"),
    _row(THROTTLING, codes="4xx", text=r"\bTS03\b", scope=DESTINATION, retry_after=_TS03_WAIT),
    # Gmail 4.7.28 (unsolicited mail rate); Microsoft 4.7.500-699 (throttled, reputation).
    _row(THROTTLING, codes="4xx", status="x.7.28 x.7.5xx x.7.6xx", scope=DESTINATION),
    _row(THROTTLING, codes="4xx", text=_THROTTLE, scope=DESTINATION),
    # Our IP or domain refused on the site's judgement (after the rate limits, which say
    # "reputation" too but ask only for patience): Gmail x.7.25 (PTR); Microsoft 5.7.501-503
    # (spam abuse), 5.7.6xx (banned IP), 5.7.705 (tenant), 5.7.708 (IP), 5.7.750 (domain).
    _row(REPUTATION, text=_REPUTATION, **_OURS),
    _row(REPUTATION, status="x.7.25", **_OURS),
    _row(
        REPUTATION,
        codes="5xx",
        status="5.7.501 5.7.502 5.7.503 5.7.6xx 5.7.705 5.7.708 5.7.750",
        **_OURS,
    ),
    # Postfix names the restriction class that refused: "<host[IP]>: Client host rejected:
    # TEXT" comes from its client restrictions (an access map listing our address, "reject"
    # for clients outside its networks), whatever TEXT says ("Access denied" by default).
    # Our address refused on the site's own list; a 5.5.x (pipelining misuse) stays protocol.
    _row(BLOCKLIST, status="- x.7.x", text=r"\bclient host rejected\b", **_OURS),
    # QQ refuses with a 550 when we send too often ("Ip frequency limited"): a pause cures it.
    _row(THROTTLING, codes="5xx", text="frequency limit", **_OURS),
    # A bare "try again later" outside RCPT, even in a 421: the site deferring us.
    _row(
        THROTTLING,
        codes="4xx",
        status="- x.7.0 x.7.1",
        text=_TRY_LATER,
        phases=_SETUP + " mail data data_end",
        scope=DESTINATION,
    ),
    # Postfix's error tarpit hanging up ("421 4.7.0 host Error: too many errors"): our
    # session drew too many refusals (greylisting, say). Its message waits as for any lost
    # session; the site's rate is not the problem, so this paces nothing.
    _row(OTHER, codes="421", text=r"\btoo many errors\b", scope=MESSAGE),
    # 421 closes the session at any phase: the site, not this message, is the problem.
    _row(THROTTLING, codes="421", status="x.7.x", scope=DESTINATION),
    _row(OTHER, codes="421", scope=DESTINATION),
    # Our client AUTH refused, or asked for (530: AUTH or STARTTLS first): the smarthost's
    # password or TLS settings are ours to fix; every message would get the same.
    _row(AUTH, codes="530", outcome=TRANSIENT, scope=DESTINATION),
    _row(AUTH, codes="5xx", phases="auth", outcome=TRANSIENT, scope=DESTINATION),
    # A bare "try again later" at RCPT: the classic greylisting reply (one recipient waits,
    # the destination is not slowed for it), unless it names a fault of the server's own.
    _row(
        GREYLISTING,
        codes="450 451",
        status="- x.7.0 x.7.1 x.2.0",
        text=_OWN_FAULT + _TRY_LATER,
        phases="rcpt",
    ),
    # Before a transaction, every failure is the host's: try the next MX. Postfix does so
    # even for a 5xx greeting (smtp_skip_5xx_greeting), so none of these bounces.
    _row(TLS, phases="starttls", outcome=TRANSIENT),
    _row(POLICY, status="x.7.x", phases=_SETUP, outcome=TRANSIENT),
    _row(OTHER, phases=_SETUP, outcome=TRANSIENT),
    # Too many recipients: send the rest in another transaction; RFC 5321 4.5.3.1.10 says
    # to take even a 552 here as temporary.
    _row(TOO_MANY_RECIPIENTS, status="x.5.3", phases="rcpt", outcome=TRANSIENT),
    _row(TOO_MANY_RECIPIENTS, codes="452", status="-", phases="rcpt"),
    _row(
        TOO_MANY_RECIPIENTS,
        codes="4xx 552",
        text="too many recipients",
        phases="rcpt",
        outcome=TRANSIENT,
    ),
    # Mailbox full is "persistent transient" (RFC 3463 X.2.2), even in a 5xx; a plain 552
    # at RCPT is RFC 5321's "exceeded storage allocation".
    _row(MAILBOX_FULL, status="x.2.2", outcome=TRANSIENT),
    _row(MAILBOX_FULL, codes="552", status=_GENERIC, phases="rcpt", outcome=TRANSIENT),
    _row(
        MAILBOX_FULL,
        status=_GENERIC,
        text=_MAILBOX_FULL,
        phases="rcpt data_end",
        outcome=TRANSIENT,
    ),
    # The address is bad for good (no such mailbox, no such domain, null MX, moved,
    # disabled): bounce and suppress. The suppression TTL undoes the rare comeback.
    _row(
        MAILBOX,
        status="x.1.0 x.1.1 x.1.2 x.1.3 x.1.6 x.1.10 x.2.1",
        phases="rcpt",
        suppress=True,
    ),
    # Microsoft 365's directory-based edge blocking: no such address in the tenant.
    _row(
        MAILBOX,
        codes="550",
        status="5.4.1",
        text="recipient address rejected",
        phases="rcpt",
        suppress=True,
    ),
    # Said in words: the words decide, whatever the enhanced code, unless the text also
    # speaks of a refusal (then it is policy, below). "Relay access denied" stays policy
    # without suppression: that MX does not take the domain (a routing fault, not the
    # mailbox's), and it speaks of the recipient, not of us.
    _row(
        MAILBOX,
        codes="5xx",
        text=_REFUSAL + f"(?:{_NO_SUCH_USER})",
        phases="rcpt",
        suppress=True,
    ),
    _row(
        MAILBOX,
        codes="550",
        status=_GENERIC + " x.5.0 x.2.0",
        text=_REFUSAL + _UNAVAILABLE,
        phases="rcpt",
        suppress=True,
    ),
    # Size and content, whatever the phase (SIZE= at MAIL, or after the data).
    _row(SIZE, status="x.3.4 x.2.3"),
    _row(SIZE, codes="552", status=_GENERIC, phases="mail data data_end"),
    _row(CONTENT, status="x.6.x"),
    _row(
        CONTENT,
        codes="5xx",
        status=_GENERIC,
        text=r"\bcontent\b|\bspam\b|\bvirus|malware",
        phases="data data_end",
    ),
    _row(POLICY, status="x.7.x"),
    _row(CONTENT, codes="554", phases="data_end"),
    _row(PROTOCOL, codes="500 501 502 503 504 555"),
    _row(PROTOCOL, status="x.5.x"),
    # MAIL FROM refused: the sender, or this message, is not welcome there.
    _row(POLICY, codes="5xx", phases="mail"),
)
