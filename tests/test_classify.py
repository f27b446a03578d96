"""Replies and their classification (mtaqueue.policy.replies, mtaqueue.policy.classify)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.config import ConfigError, ReplyRule
from mtaqueue.policy.classify import MAX_HINT, classify, compile_rules
from mtaqueue.policy.replies import NETWORK_EVENTS, PHASES, Reply
from mtaqueue.policy.verdict import ABOUT_US, KINDS, RULE_KINDS, Verdict

SETUP = ("connect", "banner", "ehlo", "starttls", "auth")
TRANSACTION = ("mail", "rcpt", "data")


def verdict_of(phase: str, code: int, message: str = "", **kwargs) -> Verdict:
    return classify(Reply.parse(phase, code, message), **kwargs)


def brief(v: Verdict) -> tuple:
    return (v.outcome, v.scope, v.kind)


# -- Reply ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "message", "enhanced", "text"),
    [
        (550, "5.1.1 No such user", "5.1.1", "No such user"),
        (250, "2.0.0 OK", "2.0.0", "OK"),
        (250, "Ok: queued as ABC", "", "Ok: queued as ABC"),
        (556, "5.1.10 Recipient address has null MX", "5.1.10", "Recipient address has null MX"),
        (550, "5.1.1", "5.1.1", ""),
        (550, "", "", ""),
        # The class must agree with the code (RFC 2034); otherwise it is just text.
        (550, "4.2.2 odd", "", "4.2.2 odd"),
        (421, "5.7.0 odd", "", "5.7.0 odd"),
        # Not an enhanced code: glued to the text, too many digits, two parts.
        (550, "5.1.1user unknown", "", "5.1.1user unknown"),
        (550, "5.1.1000 x", "", "5.1.1000 x"),
        (550, "5.1 x", "", "5.1 x"),
        # Gmail repeats the code on each line; it is removed from each.
        (
            550,
            "5.1.1 The email account that you tried to reach does not exist. Please try\n"
            "5.1.1 double-checking the recipient's email address for typos or\n"
            "5.1.1  https://support.google.com/mail/?p=NoSuchUser x-gsmtp",
            "5.1.1",
            "The email account that you tried to reach does not exist. Please try / "
            "double-checking the recipient's email address for typos or / "
            "https://support.google.com/mail/?p=NoSuchUser x-gsmtp",
        ),
        # Only the same code is removed, and only as a whole word.
        (
            550,
            "5.1.1 first\n5.1.10 second\n5.7.1 third",
            "5.1.1",
            "first / 5.1.10 second / 5.7.1 third",
        ),
        (451, "4.7.1 a\r\n\r\n4.7.1\r\n  b  ", "4.7.1", "a / b"),
        (220, "mx.example ESMTP\nready", "", "mx.example ESMTP / ready"),
    ],
)
def test_parse(code, message, enhanced, text):
    reply = Reply.parse("rcpt", code, message)
    assert (reply.phase, reply.code, reply.enhanced, reply.text) == ("rcpt", code, enhanced, text)
    assert reply.network == ""


@pytest.mark.parametrize(
    ("reply", "line"),
    [
        (Reply("rcpt", 550, "5.1.1", "No such user"), "550 5.1.1 No such user"),
        (Reply("rcpt", 550, "", "No such user"), "550 No such user"),
        (Reply("data_end", 250), "250"),
        (Reply("banner", 0, network="timeout"), "timeout while waiting for the 220 greeting"),
        (Reply("connect", 0, network="refused"), "connection refused while connecting"),
        (
            Reply("data_end", 0, network="lost"),
            "connection lost after the end of data (the message may have been delivered)",
        ),
        # The client's own description wins: it knows the address and the error.
        (Reply("connect", 0, text="192.0.2.1 refused", network="refused"), "192.0.2.1 refused"),
        # An event's own status leads, as in a reply.
        (
            Reply("dns", 0, "5.1.2", "x.example: NXDOMAIN", network="dns"),
            "5.1.2 x.example: NXDOMAIN",
        ),
        (Reply("starttls", 0, "4.7.10", network="tls"), "4.7.10 TLS failure during STARTTLS"),
    ],
)
def test_line(reply, line):
    assert reply.line() == line


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("network", NETWORK_EVENTS)
def test_every_network_event_has_a_description(phase, network):
    for reply in (Reply(phase, 0, network=network), Reply(phase, 0, "4.4.1", network=network)):
        line = reply.line()
        assert line and not line[:3].isdigit()  # a DSN must not take it for a server's reply


@pytest.mark.parametrize(
    "kwargs",
    [
        {"phase": "quit", "code": 250},
        {"phase": "rcpt", "code": 0},  # no reply and no event
        {"phase": "rcpt", "code": 550, "network": "lost"},
        {"phase": "rcpt", "code": 0, "network": "exploded"},
        {"phase": "rcpt", "code": 550, "enhanced": "5.1"},
        {"phase": "rcpt", "code": 550, "enhanced": "5.1.1 "},
    ],
)
def test_invalid_replies_are_refused(kwargs):
    with pytest.raises(ValueError):
        Reply(**kwargs)


def test_parse_roundtrips_through_line():
    reply = Reply.parse("rcpt", 550, "5.1.1 <a@b.example>: Recipient address rejected")
    assert Reply.parse("rcpt", 550, reply.line().split(" ", 1)[1]) == reply


# -- the classification table ------------------------------------------------------------------

T, P = "transient", "permanent"

# "PHASE CODE MESSAGE => OUTCOME SCOPE KIND STATUS [suppress] [after=SECONDS]"
CASES = [
    # --- RCPT: hard bounces, suppressed
    "rcpt 550 5.1.1 The email account that you tried to reach does not exist."
    " => permanent recipient mailbox 5.1.1 suppress",
    "rcpt 550 5.1.1 <a@b>: Recipient address rejected: User unknown in virtual mailbox table"
    " => permanent recipient mailbox 5.1.1 suppress",
    "rcpt 550 5.1.0 Address rejected => permanent recipient mailbox 5.1.0 suppress",
    "rcpt 550 5.1.2 Host unknown => permanent recipient mailbox 5.1.2 suppress",
    "rcpt 501 5.1.3 Bad recipient address syntax => permanent recipient mailbox 5.1.3 suppress",
    "rcpt 550 5.1.6 Mailbox has moved => permanent recipient mailbox 5.1.6 suppress",
    "rcpt 556 5.1.10 Recipient address has null MX => permanent recipient mailbox 5.1.10 suppress",
    "rcpt 550 5.2.1 The email account that you tried to reach is disabled."
    " => permanent recipient mailbox 5.2.1 suppress",
    "rcpt 550 5.4.1 Recipient address rejected: Access denied. AS(201806281)"
    " => permanent recipient mailbox 5.4.1 suppress",
    # ... or said in words, without an enhanced code (the status is derived)
    "rcpt 550 Requested action not taken: mailbox unavailable"
    " => permanent recipient mailbox 5.1.1 suppress",
    "rcpt 550 No such user here => permanent recipient mailbox 5.1.1 suppress",
    "rcpt 550 5.0.0 <a@b>... User unknown => permanent recipient mailbox 5.0.0 suppress",
    "rcpt 553 sorry, no mailbox here by that name; unknown user"
    " => permanent recipient mailbox 5.1.1 suppress",
    "rcpt 554 delivery error: dd This user doesn't have a yahoo.com account"
    " => permanent recipient mailbox 5.1.1 suppress",
    # ... but a specific code beats the words
    "rcpt 550 5.7.1 Mailbox unavailable: blocked by policy => permanent recipient policy 5.7.1",
    "rcpt 550 5.7.1 greylisted senders are not listed => permanent recipient policy 5.7.1",
    # --- RCPT: permanent, not the address's fault: no suppression
    # --- our source on a blocklist: deferred (another source takes it), never bounced
    "rcpt 550 5.7.1 Service unavailable; Client host [192.0.2.1] blocked using Spamhaus"
    " => transient destination blocklist 4.7.1",
    "banner 554 mx.example.org ESMTP not accepting mail from 192.0.2.1: listed at bl.example"
    " => transient destination blocklist 4.0.0",
    "connect 553 5.7.1 [BL21] Connections will not be accepted from 192.0.2.1, because the ip"
    " is in Spamhaus's list => transient destination blocklist 4.7.1",
    "rcpt 550 5.7.606 Access denied, banned sending IP [192.0.2.1]"
    " => transient destination blocklist 4.7.606",
    # Postfix's client restrictions (an access map's REJECT or DEFER, verbatim from a private
    # `postfix -c DIR` instance), a custom text too; not its complaint about our pipelining
    "rcpt 554 5.7.1 <unknown[127.0.0.1]>: Client host rejected: Access denied"
    " => transient destination blocklist 4.7.1",
    "rcpt 450 4.7.1 <unknown[127.0.0.1]>: Client host rejected: Access denied"
    " => transient destination blocklist 4.7.1",
    "mail 550 5.7.1 <mx.example[192.0.2.1]>: Client host rejected: no mail from your network"
    " => transient destination blocklist 4.7.1",
    "rcpt 503 5.5.0 <unknown[192.0.2.1]>: Client host rejected: Improper use of SMTP command"
    " pipelining => permanent recipient protocol 5.5.0",
    "rcpt 421 4.7.0 [TSS04] Messages from 192.0.2.1 temporarily deferred due to unexpected"
    " volume or user complaints => transient destination throttling 4.7.0",
    # --- Gmail wants IPv4 from us: retried over IPv4, not bounced
    "rcpt 550 5.7.1 [2001:db8::1] Our system has detected that this message does not meet"
    " IPv6 sending guidelines regarding PTR records and authentication."
    " => transient destination ipv6 4.7.1",
    "rcpt 554 5.7.1 <a@b>: Relay access denied => permanent recipient policy 5.7.1",
    "rcpt 553 sorry, that domain isn't in my list of allowed rcpthosts"
    " => permanent recipient other 5.0.0",
    "rcpt 550 5.4.1 Relay denied => permanent recipient other 5.4.1",
    "rcpt 503 5.5.1 Error: need MAIL command => permanent recipient protocol 5.5.1",
    "rcpt 599 something new => permanent recipient other 5.0.0",
    "rcpt 550 5.9.9 from the future => permanent recipient other 5.9.9",
    # --- RCPT: mailbox full is soft (RFC 3463), whatever the class
    "rcpt 552 5.2.2 The email account that you tried to reach is over quota."
    " => transient recipient mailbox_full 4.2.2",
    "rcpt 452 4.2.2 The email account that you tried to reach is over quota."
    " => transient recipient mailbox_full 4.2.2",
    "rcpt 550 5.2.2 Mailbox full => transient recipient mailbox_full 4.2.2",
    "rcpt 552 Requested mail action aborted: exceeded storage allocation"
    " => transient recipient mailbox_full 4.2.2",
    "rcpt 550 Mailbox is full => transient recipient mailbox_full 4.2.2",
    "rcpt 552 5.0.0 user over quota => transient recipient mailbox_full 4.0.0",
    # --- RCPT: too many recipients (RFC 5321 4.5.3.1.10; even a 552)
    "rcpt 452 4.5.3 Your message has too many recipients."
    " => transient recipient too_many_recipients 4.5.3",
    "rcpt 452 Too many recipients => transient recipient too_many_recipients 4.5.3",
    "rcpt 452 => transient recipient too_many_recipients 4.5.3",
    "rcpt 552 5.5.3 Too many recipients => transient recipient too_many_recipients 4.5.3",
    "rcpt 552 Too many recipients => transient recipient too_many_recipients 4.5.3",
    "rcpt 451 4.5.3 Too many recipients, try again later"
    " => transient recipient too_many_recipients 4.5.3",
    # 452 for something else is an ordinary deferral
    "rcpt 452 4.3.1 Insufficient system storage => transient recipient other 4.3.1",
    # --- RCPT: other deferrals
    "rcpt 450 4.1.1 <a@b>: Recipient address rejected: unverified address"
    " => transient recipient mailbox 4.1.1",
    "rcpt 450 4.2.1 Mailbox temporarily disabled => transient recipient mailbox 4.2.1",
    "rcpt 451 4.3.0 Temporary server error. Please try again later"
    " => transient recipient other 4.3.0",
    # (no PTR for our address: the site refuses our source, not this recipient)
    "rcpt 450 4.7.1 Client host rejected: cannot find your hostname"
    " => transient destination reputation 4.7.1",
    "rcpt 451 => transient recipient other 4.0.0",
    # --- greylisting: the recipient waits, the destination is not slowed
    "rcpt 450 4.2.0 <a@b>: Recipient address rejected: Greylisted, see "
    "http://postgrey.schweikert.ch/help/b.html"
    " => transient recipient greylisting 4.2.0",
    "rcpt 451 4.7.1 Greylisting in action, please come back in 00:04:57"
    " => transient recipient greylisting 4.7.1 after=297",
    "rcpt 450 4.7.1 Graylisted, please try again in 300 seconds"
    " => transient recipient greylisting 4.7.1 after=300",
    "rcpt 451 4.7.1 <a@b>: Recipient address rejected: grey-listed for 5 minutes"
    " => transient recipient greylisting 4.7.1 after=300",
    "rcpt 451 Temporarily rejected. Grey list in effect, retry in 1 hour"
    " => transient recipient greylisting 4.0.0 after=3600",
    "rcpt 450 4.7.1 Try again later => transient recipient greylisting 4.7.1",
    "rcpt 451 4.7.0 Please try again later => transient recipient greylisting 4.7.0",
    "rcpt 451 Please try again in 5 minutes => transient recipient greylisting 4.0.0 after=300",
    "rcpt 450 4.2.0 come back later => transient recipient greylisting 4.2.0",
    # --- Postfix 3.7 and postgrey as a provider, verbatim (anvil limits with
    # smtpd_client_event_limit_exceptions empty, smtpd_soft/hard_error_limit, postgrey via
    # check_policy_service; captured from a private `postfix -c DIR` instance)
    "mail 450 4.7.1 Error: too much mail from 127.0.0.1 => transient destination throttling 4.7.1",
    "rcpt 450 4.7.1 Error: too many recipients from 127.0.0.1"
    " => transient destination throttling 4.7.1",
    "banner 421 4.7.0 pfbench-2631.localdomain Error: too many connections from 127.0.0.1"
    " => transient destination throttling 4.7.0",
    "rcpt 421 4.7.0 pfbench-2631.localdomain Error: too many errors"
    " => transient message other 4.7.0",
    "mail 421 4.7.0 pfbench-2631.localdomain Error: too many errors"
    " => transient message other 4.7.0",
    "rcpt 450 4.2.0 <grey@example.org>: Recipient address rejected: Greylisted, see "
    "http://postgrey.schweikert.ch/help/example.org.html"
    " => transient recipient greylisting 4.2.0",
    # (Postfix's per-transaction recipient limit names no client: RFC 5321's, not anvil's)
    "rcpt 452 4.5.3 Error: too many recipients => transient recipient too_many_recipients 4.5.3",
    # --- throttling: the destination is paced
    "rcpt 451 4.7.650 The mail server [192.0.2.1] has been temporarily rate limited due to IP "
    "reputation."
    " => transient destination throttling 4.7.650",
    "rcpt 451 4.7.500 Server busy. Please try again later from [192.0.2.1]. (S77714)"
    " => transient destination throttling 4.7.500",
    "rcpt 421 4.7.28 Our system has detected an unusual rate of unsolicited mail originating "
    "from your IP address."
    " => transient destination throttling 4.7.28",
    "rcpt 451 4.7.0 Too many messages from your IP, slow down"
    " => transient destination throttling 4.7.0",
    "rcpt 450 4.7.1 Sending rate exceeded, wait 60s"
    " => transient destination throttling 4.7.1 after=60",
    "rcpt 451 Throttled: try again in 10 minutes"
    " => transient destination throttling 4.0.0 after=600",
    # Gmail's 4.2.1 is one mailbox's rate: that recipient, not all of Gmail
    "rcpt 450 4.2.1 The user you are trying to contact is receiving mail too quickly. Please "
    "resend your message at a later time."
    " => transient recipient throttling 4.2.1",
    "rcpt 450 4.2.1 The user you are trying to contact is receiving mail at a rate that "
    "prevents additional messages from being delivered."
    " => transient recipient throttling 4.2.1",
    # --- the greeting and EHLO: the host's problem, never a bounce
    "banner 421 4.7.0 [TSS04] Messages from 192.0.2.1 temporarily deferred due to unexpected "
    "volume or user complaints"
    " => transient destination throttling 4.7.0",
    "banner 421 4.7.0 [TS03] All messages from 192.0.2.1 will be permanently deferred; "
    "Retrying will NOT succeed."
    " => transient destination throttling 4.7.0 after=14400",
    "banner 421 4.7.0 [TS01] Messages from 192.0.2.1 temporarily deferred"
    " => transient destination throttling 4.7.0",
    "banner 421 Too many concurrent SMTP connections; please try again later."
    " => transient destination throttling 4.0.0",
    "banner 421 4.3.2 Service shutting down => transient destination other 4.3.2",
    "banner 421 mx.example Service not available, closing transmission channel"
    " => transient destination other 4.0.0",
    "banner 450 4.7.0 Try again later => transient destination throttling 4.7.0",
    "banner 451 Temporary local problem => transient host other 4.0.0",
    "banner 554 5.7.1 Your IP 192.0.2.1 is on a blocklist => transient destination blocklist 4.7.1",
    "banner 554 No SMTP service here => transient host other 4.0.0",
    "banner 521 5.3.2 does not accept mail => transient host other 4.3.2",
    "ehlo 421 4.7.0 Try again later, closing connection. (EHLO)"
    " => transient destination throttling 4.7.0",
    "ehlo 550 5.7.1 HELO name rejected => transient host policy 4.7.1",
    "ehlo 501 Syntax error => transient host other 4.0.0",
    "starttls 454 4.7.0 TLS not available due to local problem => transient host tls 4.7.0",
    "starttls 554 Command refused => transient host tls 4.7.5",
    # --- MAIL FROM: our authentication failing is about us (every message would get the
    # same): deferred for the destination, never a bounce (issue 22)
    "mail 550 5.7.1 Sender rejected: SPF fail => transient destination sender_auth 4.7.1",
    "mail 550 5.7.515 Access denied, sending domain does not meet the required authentication "
    "level."
    " => transient destination sender_auth 4.7.515",
    # --- MAIL FROM: the message (its sender)
    "mail 553 5.1.8 Sender address domain does not exist => permanent message policy 5.1.8",
    "mail 550 Sender address rejected => permanent message policy 5.0.0",
    "mail 552 5.3.4 Message size exceeds fixed limit => permanent message size 5.3.4",
    "mail 552 Message size exceeds maximum permitted => permanent message size 5.3.4",
    "mail 555 5.5.4 Unsupported option: SMTPUTF8 => permanent message protocol 5.5.4",
    "mail 451 4.3.0 Temporary lookup failure => transient message other 4.3.0",
    "mail 450 4.1.8 Sender address rejected: Domain not found => transient message other 4.1.8",
    "mail 421 4.7.0 Too many messages in this session => transient destination throttling 4.7.0",
    # --- DATA (waiting for the 354)
    "data 554 5.5.1 Error: no valid recipients => permanent message protocol 5.5.1",
    "data 451 4.3.0 Try later => transient message other 4.3.0",
    "data 552 Message too big => permanent message size 5.3.4",
    # --- after the final dot
    "data_end 554 5.7.1 Message rejected as spam => permanent message policy 5.7.1",
    "data_end 550 5.7.26 Unauthenticated email from a.example is not accepted due to domain's "
    "DMARC policy."
    " => transient destination sender_auth 4.7.26",
    "data_end 554 Transaction failed: spam message rejected => permanent message content 5.0.0",
    "data_end 554 5.6.0 Message content rejected => permanent message content 5.6.0",
    "data_end 550 5.6.1 Media not supported => permanent message content 5.6.1",
    "data_end 552 5.3.4 Message size exceeds fixed maximum message size"
    " => permanent message size 5.3.4",
    "data_end 552 Message size exceeds fixed maximum message size => permanent message size 5.3.4",
    "data_end 552 5.2.3 Message length exceeds administrative limit"
    " => permanent message size 5.2.3",
    "data_end 552 5.2.2 Mailbox full => transient message mailbox_full 4.2.2",
    "data_end 552 Sorry, mailbox full => transient message mailbox_full 4.2.2",
    "data_end 451 4.3.0 Error: queue file write error => transient message other 4.3.0",
    "data_end 451 4.7.1 Greylisted for 5 minutes => transient message greylisting 4.7.1 after=300",
    "data_end 450 4.2.1 The user you are trying to contact is receiving mail too quickly."
    " => transient message throttling 4.2.1",
    "data_end 421 4.4.2 Timeout exceeded => transient destination other 4.4.2",
    "data_end 550 Message rejected => permanent message other 5.0.0",
    # --- a smarthost: our client AUTH refused, or demanded: our config, never a bounce
    "auth 535 5.7.8 Error: authentication failed: authentication failure"
    " => transient destination auth 4.7.8",
    "auth 535 Authentication credentials invalid => transient destination auth 4.7.0",
    "auth 534 5.7.9 Authentication mechanism is too weak => transient destination auth 4.7.9",
    "auth 538 5.7.11 Encryption required for requested authentication mechanism"
    " => transient destination auth 4.7.11",
    "auth 504 5.5.4 Unrecognized authentication type => transient destination auth 4.5.4",
    "auth 502 5.5.1 Error: authentication not enabled => transient destination auth 4.5.1",
    # A temporary failure of the server's own (its password backend) is the host's.
    "auth 454 4.7.0 Temporary authentication failure => transient host policy 4.7.0",
    "auth 421 4.3.2 Service not available => transient destination other 4.3.2",
    "mail 530 5.7.0 Authentication required => transient destination auth 4.7.0",
    "mail 530 Must issue a STARTTLS command first => transient destination auth 4.7.0",
    "rcpt 530 5.7.0 Authentication required => transient destination auth 4.7.0",
    # --- successes, and codes out of place
    "data_end 250 2.0.0 OK 1700000000 x-gsmtp => delivered message ok 2.0.0",
    "data_end 250 Ok: queued as 4Z7 => delivered message ok 2.0.0",
    "rcpt 250 2.1.5 OK => delivered recipient ok 2.1.5",
    "rcpt 251 User not local; will forward => delivered recipient ok 2.0.0",
    # A step done is not a delivery; a code out of step is the host's protocol error.
    "banner 250 mx.example.org ESMTP => transient host protocol 4.5.0",
    "mail 252 2.1.0 Ok => transient host protocol 4.5.0",
    "data 250 2.0.0 Ok => transient host protocol 4.5.0",
    "data 354 Go ahead => transient host protocol 4.5.0",
    "rcpt 354 Go ahead? => transient host protocol 4.5.0",
    "rcpt 252 2.1.5 Cannot VRFY => transient host protocol 4.5.0",
    "mail 100 => transient host protocol 4.5.0",
    "rcpt 650 => transient host protocol 4.5.0",
    "rcpt -1 Malformed SMTP response => transient host protocol 4.5.0",
    # After the final dot, anything but a 2xx, 4xx or 5xx leaves it unknown.
    "data_end 354 again? => ambiguous message network 4.4.2",
    "data_end 199 => ambiguous message network 4.4.2",
]


def described(v: Verdict) -> str:
    words = [v.outcome, v.scope, v.kind, v.status]
    if v.suppress:
        words.append("suppress")
    if v.retry_after is not None:
        words.append(f"after={v.retry_after:g}")
    return " ".join(words)


@pytest.mark.parametrize("case", CASES)
def test_table(case):
    reply, expected = case.split(" => ")
    phase, code, *message = reply.split(" ", 2)
    assert described(verdict_of(phase, int(code), *message)) == expected


# -- network events ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "network", "expected"),
    [
        # Before a transaction: suspend the host, try the next MX (4.4.1 no answer from host)
        ("connect", "refused", "transient host network 4.4.1"),
        ("connect", "unreachable", "transient host network 4.4.1"),
        ("connect", "timeout", "transient host network 4.4.1"),
        ("banner", "timeout", "transient host network 4.4.2"),
        ("banner", "lost", "transient host network 4.4.2"),
        ("ehlo", "lost", "transient host network 4.4.2"),
        ("starttls", "timeout", "transient host network 4.4.2"),
        ("starttls", "tls", "transient host tls 4.7.5"),
        ("auth", "timeout", "transient host network 4.4.2"),
        ("auth", "tls", "transient host tls 4.7.5"),
        # A smarthost that offers no mechanism we can use: our config, like a refused AUTH.
        ("auth", "auth", "transient destination auth 4.7.0"),
        ("ehlo", "tls", "transient host tls 4.7.5"),
        # During a transaction: a 451 for all of it (RFC 5321 3.8), 4.4.2 bad connection
        ("mail", "timeout", "transient message network 4.4.2"),
        ("rcpt", "lost", "transient message network 4.4.2"),
        ("rcpt", "tls", "transient message network 4.4.2"),
        ("data", "timeout", "transient message network 4.4.2"),
        # After the final dot: nobody knows
        ("data_end", "lost", "ambiguous message network 4.4.2"),
        ("data_end", "timeout", "ambiguous message network 4.4.2"),
        # The next-hop lookup (4.4.3 directory server failure)
        ("dns", "dns", "transient destination dns 4.4.3"),
        ("dns", "timeout", "transient destination dns 4.4.3"),
    ],
)
def test_network_events(phase, network, expected):
    assert described(classify(Reply(phase, 0, network=network, text="seen"))) == expected


def test_network_event_keeps_its_own_status():
    v = classify(Reply("starttls", 0, "4.7.10", "mx does not offer TLS", network="tls"))
    assert described(v) == "transient host tls 4.7.10"


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("5.1.2", "permanent destination dns 5.1.2 suppress"),  # NXDOMAIN
        ("5.1.10", "permanent destination dns 5.1.10 suppress"),  # null MX
        ("5.4.4", "permanent destination dns 5.4.4"),  # no address: maybe their DNS
        ("4.4.3", "transient destination dns 4.4.3"),  # SERVFAIL, timeout
        ("", "transient destination dns 4.4.3"),
    ],
)
def test_route_failures(status, expected):
    v = classify(Reply("dns", 0, status, "a.example: what the resolver saw", network="dns"))
    assert described(v) == expected


@pytest.mark.parametrize(
    ("code", "message", "expected"),
    [
        (550, "5.1.2 no such domain", "permanent destination dns 5.1.2 suppress"),
        (451, "4.4.3 try again", "transient destination dns 4.4.3"),
        (550, "no such domain", "permanent destination dns 5.4.3"),
    ],
)
def test_coded_replies_at_dns(code, message, expected):
    assert described(verdict_of("dns", code, message)) == expected


def test_ambiguous_policy():
    lost = Reply("data_end", 0, network="lost")
    assert classify(lost) == classify(lost, ambiguous_policy="retry")
    assumed = classify(lost, ambiguous_policy="assume-delivered")
    # Delivered for the queue, but the kind keeps it apart from a real 250.
    assert brief(assumed) == ("delivered", "message", "ambiguous")
    assert assumed.status == "2.0.0"
    # A real reply after the dot is not ambiguous, whatever the policy.
    reply = Reply("data_end", 451, "4.3.0", "try later")
    assert classify(reply, ambiguous_policy="assume-delivered").outcome == T
    with pytest.raises(ValueError):
        classify(lost, ambiguous_policy="hope")


# -- server hints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("try again in 5 minutes", 300),
        ("Please try again in 299 seconds", 299),
        ("retry in 300 seconds", 300),
        ("come back in 1 hour", 3600),
        ("wait 60s", 60),
        ("wait 90 secs", 90),
        ("Try again in 2 mins", 120),
        ("retry after 1.5 hours", 5400),
        ("greylisted for 300 seconds", 300),
        ("deferred for 10m", 600),
        ("please come back in 00:04:57", 297),
        ("RETRY IN 2 HRS", 7200),
        ("try again in 9999 hours", MAX_HINT),  # a wild hint is capped
        ("try again in 0 seconds", 0),
        ("try again later", None),
        ("try again in a few minutes", None),
        ("wait 500ms", None),
        ("retry 3 times", None),
        ("4.7.1 deferred 4.7.1", None),
        ("", None),
    ],
)
def test_hints(text, seconds):
    assert verdict_of("rcpt", 451, text).retry_after == seconds


def test_hints_are_for_retries_only():
    assert verdict_of("rcpt", 550, "5.7.1 blocked, try again in 5 minutes").retry_after is None
    assert verdict_of("rcpt", 250, "ok, come back in 5 minutes").retry_after is None


# -- site rules -----------------------------------------------------------------------------


def rules(*specs: dict) -> tuple:
    return compile_rules([ReplyRule(**spec) for spec in specs])


def test_rules_come_first_and_first_match_wins():
    site = rules(
        {"match": r"^550 5\.7\.1 .*blocked", "outcome": "transient", "kind": "policy"},
        {"match": "blocked", "outcome": "permanent", "kind": "content"},
    )
    reply = Reply.parse("rcpt", 550, "5.7.1 You are blocked for now")
    assert brief(classify(reply, site)) == (T, "recipient", "policy")
    assert classify(reply, site).status == "4.7.1"
    other = Reply.parse("data_end", 554, "blocked content")
    assert brief(classify(other, site)) == (P, "message", "content")
    # No match: the built-in table
    assert brief(classify(Reply.parse("rcpt", 550, "5.1.1 no"), site)) == (
        P,
        "recipient",
        "mailbox",
    )


def test_rule_patterns_see_the_whole_line_and_ignore_case():
    site = rules({"match": "^421 4.7.0 try AGAIN later", "outcome": "permanent", "kind": "policy"})
    reply = Reply.parse("mail", 421, "4.7.0 Try again later, closing connection")
    assert brief(classify(reply, site)) == (P, "message", "policy")
    strict = rules({"match": "(?-i:^421 4.7.0 try)", "outcome": "permanent", "kind": "policy"})
    assert classify(reply, strict).kind == "throttling"


def test_rule_phase_filter():
    site = rules({"match": "550", "outcome": "transient", "kind": "other", "phase": "mail"})
    assert verdict_of("mail", 550, "no", rules=site).outcome == T
    assert verdict_of("rcpt", 550, "no", rules=site).outcome == P


def test_rule_kinds_choose_scope_and_suppression():
    throttle = rules({"match": "RL0000", "outcome": "transient", "kind": "throttling"})
    assert brief(verdict_of("rcpt", 550, "RL0000 slow down", rules=throttle)) == (
        T,
        "destination",
        "throttling",
    )
    mailbox = rules({"match": "gone away", "outcome": "permanent", "kind": "mailbox"})
    assert verdict_of("rcpt", 550, "gone away", rules=mailbox).suppress
    assert not verdict_of("mail", 550, "gone away", rules=mailbox).suppress  # the sender
    soft = rules({"match": "gone away", "outcome": "transient", "kind": "mailbox"})
    assert not verdict_of("rcpt", 550, "gone away", rules=soft).suppress
    # A rule that blames our source speaks of the whole destination, as the table does.
    for kind in ABOUT_US:
        ours = rules({"match": "go away", "outcome": "transient", "kind": kind})
        assert verdict_of("rcpt", 550, "go away", rules=ours).scope == "destination"


def test_a_permanent_rule_before_a_transaction_bounces_the_message():
    site = rules({"match": "No SMTP service", "outcome": "permanent", "kind": "policy"})
    assert brief(verdict_of("banner", 554, "No SMTP service here", rules=site)) == (
        P,
        "message",
        "policy",
    )


def test_rules_match_network_events():
    site = rules({"match": "refused", "outcome": "permanent", "kind": "other", "phase": "connect"})
    assert classify(Reply("connect", 0, network="refused"), site).outcome == P


def test_rules_cannot_overturn_a_success_or_an_ambiguity():
    anything = rules({"match": "", "outcome": "permanent", "kind": "policy"})
    assert classify(Reply.parse("rcpt", 250, "2.1.5 OK"), anything).outcome == "delivered"
    lost = Reply("data_end", 0, network="lost")
    assert classify(lost, anything).outcome == "ambiguous"
    assert classify(Reply.parse("rcpt", 451, "x"), anything).outcome == P


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"match": "(", "outcome": "permanent"}, "delivery.rules[1].match: invalid regex: "),
        ({"match": "x", "outcome": "permanent", "phase": "quit"}, "delivery.rules[1].phase: "),
        ({"match": "x", "outcome": "permanent", "kind": "throtling"}, "delivery.rules[1].kind: "),
        ({"match": "x", "outcome": "permanent", "kind": "ok"}, "delivery.rules[1].kind: "),
    ],
)
def test_bad_rules_name_the_key(spec, message):
    good = ReplyRule(match="x", outcome="transient")
    with pytest.raises(ConfigError) as info:
        compile_rules([good, ReplyRule(**spec)])
    assert str(info.value).startswith(message)


def test_every_rule_kind_compiles():
    compiled = compile_rules(
        [ReplyRule(match="x", outcome="transient", kind=k) for k in RULE_KINDS]
    )
    assert [r.kind for r in compiled] == list(RULE_KINDS)
    assert compile_rules([]) == ()


# -- properties -----------------------------------------------------------------------------

PHRASES = [
    "greylisted",
    "try again later",
    "try again in 5 minutes",
    "too many recipients",
    "too many connections",
    "rate limited",
    "[TSS04]",
    "[TS03]",
    "mailbox full",
    "user unknown",
    "receiving mail too quickly",
    "server busy",
    "spam",
    "blocked using zen.spamhaus.org",
    "SPF",
    "low reputation",
    "frequency limited",
    "no such user",
    "mailbox unavailable",
]
texts = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(PHRASES), max_size=3).map(" ".join),
)
codes = st.one_of(
    st.sampled_from([220, 250, 354, 421, 450, 451, 452, 454, 500, 501, 503, 550, 552, 553, 554]),
    st.integers(-1, 999).filter(bool),
)


@st.composite
def enhanced_codes(draw, klass: str | None = None) -> str:
    klass = klass or draw(st.sampled_from("245"))
    subject = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]) | st.integers(0, 999))
    detail = draw(st.sampled_from([0, 1, 2, 3, 4, 10, 28, 500, 650]) | st.integers(0, 999))
    return f"{klass}.{subject}.{detail}"


@st.composite
def replies(draw) -> Reply:
    phase = draw(st.sampled_from(PHASES))
    if draw(st.booleans()):
        network = draw(st.sampled_from(NETWORK_EVENTS))
        enhanced = draw(st.just("") | enhanced_codes())
        return Reply(phase, 0, enhanced, draw(texts), network=network)
    code = draw(codes)
    klass = str(code // 100)
    enhanced = draw(st.just("") | enhanced_codes(klass)) if klass in "245" else ""
    return Reply(phase, code, enhanced, draw(texts))


OUTCOME_CLASS = {"delivered": "2", "transient": "4", "ambiguous": "4", "permanent": "5"}
SCOPES = ("recipient", "message", "host", "destination")


@given(replies(), st.sampled_from(["retry", "assume-delivered"]))
def test_every_reply_gets_a_well_formed_verdict(reply, policy):
    v = classify(reply, ambiguous_policy=policy)
    assert v.outcome in OUTCOME_CLASS and v.scope in SCOPES and v.kind in KINDS
    # A DSN's status: well formed, its class agreeing with the outcome.
    assert re.fullmatch(r"[245]\.[0-9]{1,3}\.[0-9]{1,3}", v.status)
    assert v.status[0] == OUTCOME_CLASS[v.outcome]
    if reply.enhanced and v.kind != "protocol" and (reply.code, reply.phase) != (0, "data_end"):
        assert v.status[1:] == reply.enhanced[1:]  # (out of step, or lost after the dot: fixed)
    # Only a bad address is suppressed, and only when it bounces.
    if v.suppress:
        assert v.outcome == "permanent" and v.kind in ("mailbox", "dns")
        assert reply.phase in ("rcpt", "dns")
    if v.retry_after is not None:
        assert v.outcome == "transient" and 0 <= v.retry_after <= MAX_HINT
    if v.kind == "greylisting":
        assert v.outcome == "transient"
    if v.scope == "host":  # before a transaction, or a server out of step; never a bounce
        assert reply.phase in SETUP or v.kind == "protocol"
        assert v.outcome != "permanent"
    if v.kind == "protocol" and not 400 <= reply.code < 600:
        assert v.scope == "host" and v.outcome == "transient"


@given(replies())
def test_class_digit_decides_unless_known_soft(reply):
    v = classify(reply)
    klass = reply.code // 100
    if klass == 4:
        assert v.outcome == "transient"  # a 4xx never bounces
    if klass == 5:
        # (530 and a refused AUTH are our configuration's problem, a refusal of our source
        # or a frequency limit the destination's: they defer.)
        soft = v.kind in ("mailbox_full", "too_many_recipients", "auth", "ipv6", "throttling")
        soft = soft or v.kind in ABOUT_US or reply.phase in SETUP
        assert v.outcome == ("transient" if soft else "permanent")
    # Delivered is a 2xx after the final dot (or 250/251 to RCPT); a 2xx anywhere else is not.
    if v.outcome == "delivered":
        assert klass == 2 and reply.phase in ("rcpt", "data_end")
    if klass == 2 and reply.phase == "data_end":
        assert v.outcome == "delivered"


@given(replies())
def test_421_concerns_the_destination(reply):
    v = classify(reply)
    if reply.code == 421 and v.kind != "greylisting":
        assert v.scope == "destination" and v.outcome == "transient"


@given(st.sampled_from(PHASES), st.sampled_from(NETWORK_EVENTS), texts)
def test_no_reply_after_the_dot_is_ambiguous_and_nothing_else_is(phase, network, text):
    reply = Reply(phase, 0, text=text, network=network)
    v = classify(reply)
    assert (v.outcome == "ambiguous") == (phase == "data_end")
    if phase in ("data_end", "dns"):  # (a failed next-hop lookup is the destination's)
        return
    if network == "auth":  # a smarthost with no AUTH mechanism for us: our config's
        assert v.scope == "destination" and v.kind == "auth" and v.outcome == "transient"
    elif network == "protocol":  # garbage: the host's, at any phase
        assert v.scope == "host" and v.kind == "protocol"
    elif network == "local":  # our own failure: never the host's
        assert v.scope == "message" and v.outcome == "transient"
    elif phase in TRANSACTION:
        assert v.scope == "message"
    elif phase in SETUP:
        assert v.scope == "host"


@given(st.integers(0, 10**6), st.sampled_from(["seconds", "minutes", "hours", "s", "m", "h"]))
def test_hint_units(number, unit):
    scale = {"s": 1, "m": 60, "h": 3600}[unit[0]]
    v = verdict_of("rcpt", 450, f"4.7.1 greylisted, try again in {number} {unit}")
    assert v.retry_after == min(number * scale, MAX_HINT)


@given(
    st.sampled_from([c for c in (421, 450, 451, 452, 550, 552, 554)]),
    enhanced_codes(),
    st.text(alphabet=st.characters(blacklist_categories=["Cc", "Cs", "Zl", "Zp"]), max_size=60),
)
def test_parse_keeps_what_it_does_not_understand(code, enhanced, text):
    text = text.strip()
    reply = Reply.parse("rcpt", code, f"{enhanced} {text}")
    if enhanced[0] == str(code)[0]:
        assert reply.enhanced == enhanced
        assert reply.line() == " ".join(p for p in (str(code), enhanced, text) if p)
    else:
        assert reply.enhanced == ""
        assert reply.text == f"{enhanced} {text}".strip()
