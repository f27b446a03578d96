"""A synthetic large mailbox provider (aiosmtpd) for benchmarks and tests.

    python bench/synthetic_peer.py --listen 127.0.0.2:2600 --listen 127.0.0.3:2600 \\
        --greylist 300 --rate 100/min --max-connections 10 --slow-banner-at 8 \\
        --slow-factor 0.05 --blocklist-after 5 --blocklist-for 600 \\
        --bounce user1@example.org --bounce-file FILE --duration 900 --idle-exit 30 \\
        --report report.json --time-scale 0.01

It answers like a big provider under load would, with shared state across every `--listen`
address (several MX hosts of one provider): rate limits, greylisting and the blocklist are per
provider and per client IP. Every behaviour is off unless its option is given.

Order of the checks:

- an outage (`--start-down`, until SIGUSR1): every connection gets `421 4.3.2 Service not
  available` and is closed; counted apart (report "outage"), not with the replies.
- connect: blocklisted -> `550 5.7.1 ... blocked using our blocklist` (close); the connection
  counts towards the blocklist if the client was told 421 less than `--blocklist-window`
  seconds ago; concurrent connections of this IP already at `--max-connections` ->
  `421 4.7.0 Too many concurrent SMTP connections ...` (close); else the banner, delayed by
  silent throttling.
- MAIL: blocklisted -> 550 5.7.1 (the session stays open); counts towards the blocklist
  (like a connection); the per-IP rate (GCRA, one token per MAIL, burst `--burst`, default
  the count of `--rate`) exceeded -> `421 4.7.28 ... temporarily rate limited` (close).
  The rate is checked at MAIL, not at connect: it limits messages, and
  `--max-connections` limits connections.
- RCPT: listed in `--bounce`/`--bounce-file` -> `550 5.1.1 ... does not exist` (hard
  bounces are never greylisted); a new (client IP, sender, recipient) triplet ->
  `450 4.2.0 Greylisted, please try again in N seconds` until the window has passed since
  it was first seen, then it passes for good.
- after the final dot: `250 2.0.0 Ok: queued as SYN<n>`; the message is counted by its
  Message-ID header (scanned in the header bytes; the body is never kept).

Silent throttling: while an IP has more than `--slow-banner-at` sessions open, the banner
and every reply to it wait `--slow-factor * (open sessions - threshold)` seconds.

Blocklist: after a 421 (4.7.28 or 4.7.0) the client is watched for `--blocklist-window`
seconds (60 by default; every further 421 extends the watch); more than `--blocklist-after`
new connections, or more than that many MAIL commands, inside the watch blocklist it for
`--blocklist-for` seconds. Connections while blocked do not extend the block. On release
the watch starts clean. `--blocklist-throttles N` also lists a client told more than N
421s (rate or connection cap) within `--blocklist-window` seconds, however few
connections or MAILs it opened meanwhile.

`--time-scale S` multiplies the policy windows: greylist window, rate period,
`--blocklist-for` and `--blocklist-window`. `--time-scale 0.01` makes a 300 s greylist 3 s
and 100/min 100 per 0.6 s. Replies state real (scaled) seconds: the greylist hint says
"3 seconds". Not scaled: `--slow-factor` (a reply latency; a client must be able to measure
it), `--duration`, `--idle-exit`, `--timeout`.

The run ends after `--duration` seconds (default 3600), after `--idle-exit` seconds without
SMTP traffic (no new connection, no command) once at least one message was accepted, or on
SIGTERM/SIGINT. The JSON report goes to `--report` (or stdout) and the exit status is 0.
Only loopback (127.0.0.0/8) addresses are accepted. "--listen 127.0.0.2:0 --listen
127.0.0.3:0" puts every port-0 address on one ephemeral port (like MX hosts sharing port 25);
the line "synthetic_peer: listening on ..." on stderr names it.

In-process (tests):

    with SyntheticPeer(["127.0.0.2:0"], greylist=300, time_scale=0.001) as peer:
        ...  # smtplib / aiosmtplib against peer.host, peer.port
        assert peer.report()["messages"]["accepted"] == 1

A variant (bench/slow_peer.py) subclasses SyntheticPeer with its own `session_class` and
reuses the command line: build_parser(), peer_options(parser, args), serve_cli(peer, args).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session, syntax

REPORT_VERSION = 1
TIMELINE_FIELDS = ["time", "message_id", "rcpts", "client", "mx", "size"]
MAX_TIMELINE = 2_000_000  # accepted messages kept for the timeline (the counts go on)
MAX_REJECTIONS = 200_000  # 4xx/5xx replies kept for the rejection timeline
MAX_ERRORS = 100

REPLY_GREYLIST = "450 4.2.0 Greylisted, please try again in {} seconds"
REPLY_RATE_GMAIL = (
    "421 4.7.28 [{ip}] Our system has detected an unusual rate of unsolicited mail originating"
    " from your IP address. To protect our users from spam, mail sent from your IP address has"
    " been temporarily rate limited. Please visit"
    " https://support.google.com/mail/?p=UnsolicitedRateLimitError to review our Bulk Email"
    " Senders Guidelines."
)
REPLY_RATE_YAHOO = (
    "421 4.7.0 [TSS04] Messages from {ip} temporarily deferred due to unexpected volume or"
    " user complaints - 4.16.55.1; see https://postmaster.yahooinc.com/error-codes"
)
REPLY_TOO_MANY = (
    "421 4.7.0 Too many concurrent SMTP connections from this IP address; please try again later."
)
REPLY_BLOCKED = "550 5.7.1 Service unavailable; client [{ip}] blocked using our blocklist"
# An outage (--start-down until SIGUSR1): every connection gets this and is closed. Not
# counted with the replies: the figures of the recovery are about the provider up.
REPLY_DOWN = "421 4.3.2 Service not available, closing transmission channel\r\n"
REPLY_NO_SUCH_USER = (
    "550 5.1.1 The email account that you tried to reach does not exist. Please try"
    " double-checking the recipient's email address for typos or unnecessary spaces."
)

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_RE = re.compile(
    r"^\s*(\d+)\s*/\s*(\d*\.?\d*)\s*(s|secs?|seconds?|m|mins?|minutes?|h|hrs?|hours?|d|days?)\s*$",
    re.I,
)
# A Message-ID header line (any case) and its folded continuation lines.
_MESSAGE_ID_RE = re.compile(rb"^message-id[ \t]*:[ \t]*(.*(?:\r?\n[ \t].*)*)", re.I | re.M)
_WSP_RE = re.compile(r"\s+")


# -- small parsers ------------------------------------------------------------------------


def parse_rate(text: str) -> tuple[int, float]:
    """ "100/min" -> (100, 60.0); also "5/10s", "3600/h", "2/1.5m"."""
    m = _RATE_RE.match(text)
    if not m or int(m[1]) < 1:
        raise ValueError(f"bad rate {text!r}: use COUNT/PERIOD, e.g. 100/min, 5/10s, 3600/h")
    period = float(m[2] or 1) * _UNITS[m[3][0].lower()]
    if period <= 0:
        raise ValueError(f"bad rate {text!r}: the period must be positive")
    return int(m[1]), period


def parse_listen(text: str | tuple[str, int]) -> tuple[str, int]:
    """Parse IP:PORT: "127.0.0.2:2600" -> ("127.0.0.2", 2600). Only 127.0.0.0/8."""
    if isinstance(text, tuple):
        host, port = text
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not port_text.isdigit():
            raise ValueError(f"bad listen address {text!r}: use IP:PORT, e.g. 127.0.0.2:2600")
        port = int(port_text)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"bad listen address {text!r}: the host must be an IP") from None
    if address.version != 4 or address not in ipaddress.ip_network("127.0.0.0/8"):
        raise ValueError(f"refusing {host}: only loopback addresses (127.0.0.0/8)")
    if not 0 <= port <= 65535:
        raise ValueError(f"bad port in {text!r}")
    return str(address), int(port)


def message_id(content: bytes) -> str | None:
    """The Message-ID of a message, from its header section only (folding undone)."""
    end = content.find(b"\r\n\r\n")
    if end < 0:
        end = content.find(b"\n\n")
    if end < 0:
        end = len(content)
    m = _MESSAGE_ID_RE.search(content, 0, end + 2)
    if m is None:
        return None
    value = _WSP_RE.sub(" ", m[1].decode("utf-8", "replace")).strip()
    return value or None


def read_bounce_file(path: str | Path) -> list[str]:
    """One address per line; blank lines and lines starting with # are skipped."""
    addresses = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            addresses.append(line)
    return addresses


def reply_key(status: str) -> str:
    """Code and enhanced code: "450 4.2.0 Greylisted" -> "450 4.2.0"; "250 OK" -> "250"."""
    code = status[:3]
    if len(status) > 8 and status[3] == " " and status[4] == code[0]:
        end = status.find(" ", 4)
        enhanced = status[4:] if end < 0 else status[4:end]
        if enhanced.count(".") == 2:
            return f"{code} {enhanced}"
    return code


# -- per-client state ---------------------------------------------------------------------


class _Client:
    __slots__ = (
        "accepted",
        "active",
        "blocked_until",
        "bounced",
        "capped",
        "connections",
        "greylisted",
        "hits",
        "ip",
        "listings",
        "peak",
        "rate_limited",
        "tat",
        "throttled_at",
        "watch_conns",
        "watch_mails",
        "watch_until",
    )

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.connections = 0  # TCP connections opened
        self.active = 0  # admitted sessions open now
        self.peak = 0  # peak of `active`
        self.accepted = 0
        self.capped = 0  # 421 4.7.0 at the greeting
        self.rate_limited = 0  # 421 at MAIL
        self.greylisted = 0
        self.bounced = 0
        self.listings = 0  # times blocklisted
        self.hits = 0  # replies 550 5.7.1
        self.tat = 0.0  # GCRA theoretical arrival time (monotonic)
        self.watch_until = 0.0  # after a 421: connections/MAILs are counted until then
        self.watch_conns = 0
        self.watch_mails = 0
        self.throttled_at: deque[float] = deque()  # 421s told inside the window
        self.blocked_until = 0.0

    def as_dict(self) -> dict[str, int]:
        return {
            "connections": self.connections,
            "peak_concurrent": self.peak,
            "accepted": self.accepted,
            "connection_limited": self.capped,
            "rate_limited": self.rate_limited,
            "greylisted": self.greylisted,
            "bounced": self.bounced,
            "blocklisted": self.listings,
            "blocklist_hits": self.hits,
        }


# -- the SMTP protocol (one instance per connection) --------------------------------------


class _Session(SMTP):
    command_size_limit = 1000
    command_size_limits = defaultdict(lambda: 1000)  # cleared by aiosmtpd per connection

    def __init__(self, peer: SyntheticPeer) -> None:
        super().__init__(
            peer._handler,
            hostname=peer.hostname,
            ident="ESMTP synthetic_peer",
            enable_SMTPUTF8=True,
            data_size_limit=peer.data_size_limit,
            timeout=peer.timeout,
            loop=peer._loop,
        )
        self._peer = peer
        self._client: _Client | None = None
        self._sockname: tuple[str, int] = ("", 0)
        self._admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        sockname = transport.get_extra_info("sockname")
        self._sockname = (sockname[0], sockname[1]) if sockname else ("", 0)
        self._client = self._peer._connection_made(self, peername[0] if peername else "")
        super().connection_made(transport)
        if self._handler_coroutine is not None:
            self._handler_coroutine.add_done_callback(self._session_done)

    def _session_done(self, task: asyncio.Task[None]) -> None:
        # Retrieve the outcome so asyncio never logs it; resets by clients are normal.
        if not task.cancelled():
            error = task.exception()
            if error is not None and not isinstance(error, ConnectionError):
                self._peer._error(error)

    def connection_lost(self, error: Exception | None) -> None:
        try:
            super().connection_lost(error)
        finally:
            self._peer._connection_lost(self)

    async def _handle_client(self) -> None:
        if self._peer.down:
            self._peer.down_refusals += 1
            assert self.transport is not None
            self.transport.write(REPLY_DOWN.encode())
            self.transport.close()
            return
        reply = self._peer._on_connect(self)
        if reply is None:
            await super()._handle_client()  # pushes the 220 banner (delayed when throttled)
            return
        try:
            await self.push(reply)
        finally:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

    async def push(self, status: str | bytes) -> None:
        peer = self._peer
        if self.transport is None or self.transport.is_closing():
            return  # after its 421: pipelined commands behind it get no reply (none counted)
        if self._admitted and peer._slow_factor:
            delay = peer._delay(self._client)
            if delay > 0:
                await asyncio.sleep(delay)
        if isinstance(status, bytes):
            status = status.decode("utf-8", "replace")
        peer._replied(status, self._client)
        await super().push(status)
        if status.startswith("421"):
            # A 421 ends the session, as real servers do; like QUIT, also stop reading so
            # pipelined commands behind it get no replies (and are not counted).
            if self._handler_coroutine is not None:
                self._handler_coroutine.cancel()
            if self.transport is not None:
                self.transport.close()

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str) -> None:
        if not hostname:
            await self.push("501 5.5.4 Syntax: EHLO hostname")
            return
        self._set_rset_state()
        assert self.session is not None
        self.session.extended_smtp = True
        self.session.host_name = hostname
        await self.push(self._peer._ehlo_reply)  # one write, one (throttle) delay


class _Handler:
    """aiosmtpd hooks (kept tiny: aiosmtpd runs dir() on it for every connection)."""

    def __init__(self, peer: SyntheticPeer) -> None:
        self.peer = peer

    async def handle_MAIL(
        self, server: _Session, session: Session, envelope: Envelope, address: str, options: list
    ) -> str:
        reply = self.peer._on_mail(server._client)
        if reply is None:
            envelope.mail_from = address
            envelope.mail_options.extend(options)
            return "250 2.1.0 Ok"
        return reply

    async def handle_RCPT(
        self, server: _Session, session: Session, envelope: Envelope, address: str, options: list
    ) -> str:
        reply = self.peer._on_rcpt(server._client, envelope.mail_from, address)
        if reply is None:
            envelope.rcpt_tos.append(address)
            envelope.rcpt_options.extend(options)
            return "250 2.1.5 Ok"
        return reply

    async def handle_DATA(self, server: _Session, session: Session, envelope: Envelope) -> str:
        return self.peer._on_data(server, envelope)

    async def handle_RSET(self, server: _Session, session: Session, envelope: Envelope) -> str:
        return "250 2.0.0 Ok"

    async def handle_NOOP(
        self, server: _Session, session: Session, envelope: Envelope, arg: str
    ) -> str:
        return "250 2.0.0 Ok"

    async def handle_QUIT(self, server: _Session, session: Session, envelope: Envelope) -> str:
        return "221 2.0.0 Bye"

    async def handle_exception(self, error: Exception) -> str:
        self.peer._error(error)
        return f"451 4.3.0 Internal error ({type(error).__name__})"


# -- the provider -------------------------------------------------------------------------


class SyntheticPeer:
    """A synthetic mailbox provider listening on one or more loopback addresses.

    Durations are given unscaled (as on the command line) and multiplied by `time_scale`.
    `rate` is "COUNT/PERIOD" or (count, period seconds). `start()` runs it in a background
    thread; `serve()` runs it in the caller's loop (the CLI). `report()` is thread-safe.
    """

    session_class: type[_Session] = _Session  # a subclass may answer differently

    def __init__(
        self,
        listen: str | tuple[str, int] | Iterable[str | tuple[str, int]] = ("127.0.0.2:0",),
        *,
        greylist: float = 0.0,
        rate: str | tuple[int, float] | None = None,
        burst: int | None = None,
        rate_style: str = "gmail",
        max_connections: int | None = None,
        slow_banner_at: int | None = None,
        slow_factor: float = 0.05,
        blocklist_after: int | None = None,
        blocklist_throttles: int | None = None,
        blocklist_for: float = 600.0,
        blocklist_window: float = 60.0,
        bounces: Iterable[str] = (),
        time_scale: float = 1.0,
        hostname: str = "mx.synthetic.test",
        timeout: float = 300.0,
        data_size_limit: int = 35_882_577,
        timeline: bool = True,
        down: bool = False,
    ) -> None:
        self.down = down  # an outage: every connection refused with REPLY_DOWN
        self.down_refusals = 0
        self.up_at: float | None = None  # epoch seconds the outage ended (come_up)
        if isinstance(listen, str | tuple):
            listen = [listen]
        self.listen = [parse_listen(item) for item in listen]
        if not self.listen:
            raise ValueError("at least one listen address")
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if greylist < 0 or blocklist_for < 0 or blocklist_window <= 0 or slow_factor < 0:
            raise ValueError("durations must be >= 0 (blocklist_window > 0)")
        if rate_style not in ("gmail", "yahoo"):
            raise ValueError("rate_style is gmail or yahoo")
        for name, value in (
            ("max_connections", max_connections),
            ("blocklist_after", blocklist_after),
            ("blocklist_throttles", blocklist_throttles),
            ("burst", burst),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if slow_banner_at is not None and slow_banner_at < 0:
            raise ValueError("slow_banner_at must be >= 0")
        self.time_scale = float(time_scale)
        self.hostname = hostname
        self.timeout = timeout
        self.data_size_limit = data_size_limit
        self.greylist = float(greylist)
        self.rate = parse_rate(rate) if isinstance(rate, str) else rate
        self.burst = burst if burst is not None else (self.rate[0] if self.rate else None)
        self.rate_style = rate_style
        self.max_connections = max_connections
        self.slow_banner_at = slow_banner_at
        self.slow_factor = float(slow_factor)
        self.blocklist_after = blocklist_after
        self.blocklist_throttles = blocklist_throttles
        self.blocklist_for = float(blocklist_for)
        self.blocklist_window = float(blocklist_window)
        self.bounces = frozenset(address.strip().lower() for address in bounces)
        self.keep_timeline = timeline

        # Effective (scaled) values used on the hot path.
        scale = self.time_scale
        self._greylist = self.greylist * scale
        if self.rate:
            self._emission = self.rate[1] * scale / self.rate[0]
            self._tau = self._emission * (self.burst - 1)
        else:
            self._emission = self._tau = 0.0
        self._block_for = self.blocklist_for * scale
        self._block_window = self.blocklist_window * scale
        self._slow_factor = self.slow_factor if slow_banner_at is not None else 0.0
        self._slow_at = slow_banner_at or 0
        self._rate_reply = REPLY_RATE_GMAIL if rate_style == "gmail" else REPLY_RATE_YAHOO
        ehlo = [hostname, f"SIZE {data_size_limit}", "8BITMIME", "PIPELINING"]
        ehlo += ["SMTPUTF8", "ENHANCEDSTATUSCODES"]
        self._ehlo_reply = "\r\n".join([f"250-{line}" for line in ehlo[:-1]] + [f"250 {ehlo[-1]}"])
        self._handler = _Handler(self)
        self._reset_state()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread_id: int | None = None
        self._servers: list[asyncio.Server] = []
        self._stop_event: asyncio.Event | None = None
        self._stop_reason: str | None = None
        self._final: dict[str, Any] | None = None
        self.addresses: list[tuple[str, int]] = []

    def _reset_state(self) -> None:
        self._clients: dict[str, _Client] = {}
        self._sessions: set[_Session] = set()
        self._greylist_seen: dict[tuple[str, str, str], float] = {}
        self._replies: dict[str, int] = {}
        self._recipients: dict[str, int] = {}
        self._by_mx: dict[tuple[str, int], list[int]] = {}  # [connections, accepted]
        self._timeline: list[tuple] = []
        self._rejections: list[tuple[float, str, str]] = []
        self._errors: list[str] = []
        self.accepted = 0
        self.recipients_accepted = 0
        self.connections = 0
        self.open = 0  # TCP connections open now (admitted or not)
        self.active = 0  # admitted sessions open now
        self.max_open = 0
        self.max_active = 0
        self.max_active_per_client = 0
        self.greylist_deferrals = 0
        self.rate_limited = 0
        self.connection_limited = 0
        self.blocklistings = 0
        self.blocklist_hits = 0
        self.hard_bounces = 0
        self.delayed_replies = 0
        self.delay_total = 0.0
        self.delay_max = 0.0
        self.timeline_dropped = 0
        self.rejections_dropped = 0
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self.last_activity = self._started_mono
        self.first_accepted_at: float | None = None
        self.last_accepted_at: float | None = None

    # -- properties for clients of the class --

    @property
    def host(self) -> str:
        return self.addresses[0][0] if self.addresses else self.listen[0][0]

    @property
    def port(self) -> int:
        return self.addresses[0][1] if self.addresses else self.listen[0][1]

    def __repr__(self) -> str:
        where = ", ".join(f"{h}:{p}" for h, p in self.addresses or self.listen)
        return f"<SyntheticPeer {where} accepted={self.accepted}>"

    # -- decisions (all run in the loop thread) --

    def _client_for(self, ip: str) -> _Client:
        client = self._clients.get(ip)
        if client is None:
            client = self._clients[ip] = _Client(ip)
        return client

    def _connection_made(self, session: _Session, ip: str) -> _Client:
        client = self._client_for(ip)
        client.connections += 1
        self.connections += 1
        self.open += 1
        if self.open > self.max_open:
            self.max_open = self.open
        self._sessions.add(session)
        counts = self._by_mx.get(session._sockname)
        if counts is None:
            counts = self._by_mx[session._sockname] = [0, 0]
        counts[0] += 1
        self.last_activity = time.monotonic()
        return client

    def _connection_lost(self, session: _Session) -> None:
        if session in self._sessions:
            self._sessions.discard(session)
            self.open -= 1
            if session._admitted:
                session._admitted = False
                self.active -= 1
                session._client.active -= 1

    def _on_connect(self, session: _Session) -> str | None:
        """None admits the session; else the greeting that refuses it."""
        client = session._client
        now = time.monotonic()
        if client.blocked_until:
            if now < client.blocked_until:
                return self._blocked(client)
            client.blocked_until = 0.0  # released; the watch starts clean
        self._watch(client, now, mail=False)
        if client.blocked_until:
            return self._blocked(client)
        if self.max_connections is not None and client.active >= self.max_connections:
            client.capped += 1
            self.connection_limited += 1
            self._told_421(client, now)
            return REPLY_TOO_MANY
        session._admitted = True
        client.active += 1
        self.active += 1
        if client.active > client.peak:
            client.peak = client.active
            if client.peak > self.max_active_per_client:
                self.max_active_per_client = client.peak
        if self.active > self.max_active:
            self.max_active = self.active
        return None

    def _on_mail(self, client: _Client) -> str | None:
        now = time.monotonic()
        if client.blocked_until:
            if now < client.blocked_until:
                return self._blocked(client)
            client.blocked_until = 0.0
        self._watch(client, now, mail=True)
        if client.blocked_until:
            return self._blocked(client)
        if self._emission:
            tat = client.tat if client.tat > now else now
            if tat - now > self._tau:
                client.rate_limited += 1
                self.rate_limited += 1
                self._told_421(client, now)
                return self._rate_reply.format(ip=client.ip)
            client.tat = tat + self._emission
        return None

    def _on_rcpt(self, client: _Client, sender: str, address: str) -> str | None:
        lowered = address.lower()
        if lowered in self.bounces:
            client.bounced += 1
            self.hard_bounces += 1
            return REPLY_NO_SUCH_USER
        if self._greylist:
            now = time.monotonic()
            key = (client.ip, sender.lower(), lowered)
            first = self._greylist_seen.get(key)
            if first is None:
                first = self._greylist_seen[key] = now
            remaining = first + self._greylist - now
            if remaining > 0:
                client.greylisted += 1
                self.greylist_deferrals += 1
                return REPLY_GREYLIST.format(max(1, math.ceil(remaining)))
        return None

    def _on_data(self, session: _Session, envelope: Envelope) -> str:
        content = envelope.original_content or b""
        now = time.time()
        self.accepted += 1
        if self.first_accepted_at is None:
            self.first_accepted_at = now
        self.last_accepted_at = now
        client = session._client
        client.accepted += 1
        self._by_mx[session._sockname][1] += 1
        rcpts = [address.lower() for address in envelope.rcpt_tos]
        self.recipients_accepted += len(rcpts)
        counts = self._recipients
        for address in rcpts:
            counts[address] = counts.get(address, 0) + 1
        if len(self._timeline) < MAX_TIMELINE:
            self._timeline.append(
                (now, message_id(content), rcpts, client.ip, session._sockname, len(content))
            )
        else:
            self.timeline_dropped += 1
        return f"250 2.0.0 Ok: queued as SYN{self.accepted}"

    def _watch(self, client: _Client, now: float, *, mail: bool) -> None:
        """Count a connection or MAIL while watched after a 421; blocklist a hammerer."""
        if self.blocklist_after is None or now >= client.watch_until:
            return
        if mail:
            client.watch_mails += 1
            count = client.watch_mails
        else:
            client.watch_conns += 1
            count = client.watch_conns
        if count > self.blocklist_after:
            self._list(client, now)

    def _told_421(self, client: _Client, now: float) -> None:
        if self.blocklist_throttles is not None:
            told = client.throttled_at
            told.append(now)
            while told[0] <= now - self._block_window:
                told.popleft()
            if len(told) > self.blocklist_throttles:
                self._list(client, now)
                told.clear()
                return
        if self.blocklist_after is None:
            return
        if now >= client.watch_until:
            client.watch_conns = client.watch_mails = 0
        client.watch_until = now + self._block_window

    def _list(self, client: _Client, now: float) -> None:
        client.blocked_until = now + self._block_for
        client.listings += 1
        self.blocklistings += 1
        client.watch_until = 0.0
        client.watch_conns = client.watch_mails = 0

    def _blocked(self, client: _Client) -> str:
        client.hits += 1
        self.blocklist_hits += 1
        return REPLY_BLOCKED.format(ip=client.ip)

    def _delay(self, client: _Client) -> float:
        over = client.active - self._slow_at
        if over <= 0:
            return 0.0
        delay = self._slow_factor * over
        self.delayed_replies += 1
        self.delay_total += delay
        if delay > self.delay_max:
            self.delay_max = delay
        return delay

    def come_up(self) -> None:
        """The outage is over (SIGUSR1): connections are answered again."""
        if self.down:
            self.down, self.up_at = False, time.time()

    def _replied(self, status: str, client: _Client | None) -> None:
        now = time.monotonic()
        self.last_activity = now
        key = reply_key(status)
        self._replies[key] = self._replies.get(key, 0) + 1
        if status[0] in "45":
            if len(self._rejections) < MAX_REJECTIONS:
                ip = client.ip if client is not None else ""
                self._rejections.append((time.time(), key, ip))
            else:
                self.rejections_dropped += 1

    def _error(self, error: BaseException) -> None:
        if len(self._errors) < MAX_ERRORS:
            self._errors.append(f"{type(error).__name__}: {error}")

    # -- the report --

    def _build_report(self, reason: str) -> dict[str, Any]:
        ended = time.time()
        by_id: dict[str, int] = {}
        pairs: dict[tuple[str, str], int] = {}
        without_id = 0
        for _t, mid, rcpts, *_ in self._timeline:
            if mid is None:
                without_id += 1
                continue
            by_id[mid] = by_id.get(mid, 0) + 1
            for rcpt in rcpts:
                pairs[mid, rcpt] = pairs.get((mid, rcpt), 0) + 1
        duplicates: dict[str, dict[str, Any]] = {}
        for mid, count in by_id.items():
            if count > 1:
                duplicates[mid] = {"transactions": count, "recipients": {}}
        duplicate_deliveries = 0
        for (mid, rcpt), count in pairs.items():
            if count > 1:
                duplicate_deliveries += count - 1
                duplicates[mid]["recipients"][rcpt] = count
        classes = {"2xx": 0, "3xx": 0, "4xx": 0, "5xx": 0}
        for key, count in self._replies.items():
            cls = f"{key[0]}xx"
            classes[cls] = classes.get(cls, 0) + count
        scale = self.time_scale
        report: dict[str, Any] = {
            "tool": "synthetic_peer",
            "version": REPORT_VERSION,
            "exit_reason": reason,
            "started_at": round(self.started_at, 6),
            "ended_at": round(ended, 6),
            "elapsed_s": round(ended - self.started_at, 6),
            "listen": [f"{h}:{p}" for h, p in self.addresses or self.listen],
            "settings": {
                "time_scale": scale,
                "greylist_s": self.greylist,
                "rate": f"{self.rate[0]}/{self.rate[1]:g}s" if self.rate else None,
                "burst": self.burst,
                "rate_style": self.rate_style,
                "max_connections": self.max_connections,
                "slow_banner_at": self.slow_banner_at,
                "slow_factor_s": self.slow_factor,
                "blocklist_after": self.blocklist_after,
                "blocklist_throttles": self.blocklist_throttles,
                "blocklist_for_s": self.blocklist_for,
                "blocklist_window_s": self.blocklist_window,
                "bounces": len(self.bounces),
                "effective": {  # after --time-scale, in real seconds
                    "greylist_s": self._greylist,
                    "rate_period_s": self.rate[1] * scale if self.rate else None,
                    "rate_interval_s": self._emission or None,
                    "blocklist_for_s": self._block_for,
                    "blocklist_window_s": self._block_window,
                },
            },
            "outage": {"refusals": self.down_refusals, "up_at": self.up_at},
            "connections": {
                "total": self.connections,
                "open": self.open,
                "max_open": self.max_open,
                "max_concurrent": self.max_active,
                "max_concurrent_per_client": self.max_active_per_client,
            },
            "messages": {
                "accepted": self.accepted,
                "recipients_accepted": self.recipients_accepted,
                "unique_message_ids": len(by_id),
                "without_message_id": without_id,
                "duplicate_message_ids": len(duplicates),
                "duplicate_transactions": sum(c - 1 for c in by_id.values()),
                "duplicate_deliveries": duplicate_deliveries,
                "first_accepted_at": self.first_accepted_at,
                "last_accepted_at": self.last_accepted_at,
            },
            "replies": dict(sorted(self._replies.items())),
            "reply_classes": classes,
            "greylist": {
                "deferrals": self.greylist_deferrals,
                "triplets_seen": len(self._greylist_seen),
            },
            "rate_limited": self.rate_limited,
            "connection_limited": self.connection_limited,
            "replies_421": sum(c for k, c in self._replies.items() if k.startswith("421")),
            "blocklist": {
                "listings": self.blocklistings,
                "hits": self.blocklist_hits,
                "clients": sorted(ip for ip, c in self._clients.items() if c.listings),
            },
            "hard_bounces": self.hard_bounces,
            "throttling": {
                "delayed_replies": self.delayed_replies,
                "delay_total_s": round(self.delay_total, 6),
                "delay_max_s": round(self.delay_max, 6),
            },
            "clients": {ip: c.as_dict() for ip, c in sorted(self._clients.items())},
            "mx": {
                f"{h}:{p}": {"connections": n[0], "accepted": n[1]}
                for (h, p), n in sorted(self._by_mx.items())
            },
            "duplicates": duplicates,
            "recipients": dict(sorted(self._recipients.items())),
            "errors": list(self._errors),
            "timeline_dropped": self.timeline_dropped,
            "rejections_dropped": self.rejections_dropped,
            "rejections_fields": ["time", "reply", "client"],
            "rejections": [[round(t, 6), key, ip] for t, key, ip in self._rejections],
        }
        if self.keep_timeline:
            report["timeline_fields"] = TIMELINE_FIELDS
            report["timeline"] = [
                [round(t, 6), mid, rcpts, ip, f"{mx[0]}:{mx[1]}", size]
                for t, mid, rcpts, ip, mx, size in self._timeline
            ]
        return report

    def report(self) -> dict[str, Any]:
        """The report as a dict (final after stop; a live snapshot while running)."""
        loop = self._loop
        if loop is None or not loop.is_running():
            if self._final is not None:
                return self._final
            return self._build_report(self._stop_reason or "not started")
        if threading.get_ident() == self._loop_thread_id:
            return self._build_report("running")

        async def snapshot() -> dict[str, Any]:
            return self._build_report("running")

        future = asyncio.run_coroutine_threadsafe(snapshot(), loop)
        deadline = time.monotonic() + 30
        while True:
            try:
                return future.result(0.05)
            except TimeoutError:
                if self._final is not None:  # the loop ended first
                    future.cancel()
                    return self._final
                if time.monotonic() > deadline:
                    raise

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> dict:
        """Poll report() until predicate(report) holds; returns that report."""
        deadline = time.monotonic() + timeout
        while True:
            report = self.report()
            if predicate(report):
                return report
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self!r}: condition not met in {timeout} s")
            time.sleep(0.01)

    # -- life --

    async def serve(
        self,
        duration: float | None = None,
        idle_exit: float | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> str:
        """Listen and answer until stopped, `duration` or `idle_exit`; returns the reason.

        `on_ready()` is called once listening (`addresses` is set). The final report is then
        available from report().
        """
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._stop_event = asyncio.Event()
        self._stop_reason = None
        self._final = None
        self._reset_state()
        reason = "error"
        try:
            await self._listen()
            if on_ready is not None:
                on_ready()
            reason = await self._run(duration, idle_exit)
        finally:
            await self._shutdown()
            self._stop_reason = reason
            self._final = self._build_report(reason)
        return reason

    async def _run(self, duration: float | None, idle_exit: float | None) -> str:
        assert self._stop_event is not None
        started = time.monotonic()
        tick = 0.5
        if duration:
            tick = min(tick, max(0.01, duration / 20))
        if idle_exit:
            tick = min(tick, max(0.01, idle_exit / 10))
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), tick)
            if self._stop_event.is_set():
                return self._stop_reason or "stopped"
            now = time.monotonic()
            if duration and now - started >= duration:
                return "duration"
            if idle_exit and self.accepted and now - self.last_activity >= idle_exit:
                return "idle"

    def request_stop(self, reason: str = "stopped") -> None:
        """Ask the running peer to finish (thread-safe; also fine from signal handlers)."""
        loop, event = self._loop, self._stop_event
        if loop is None or event is None or loop.is_closed():
            return

        def stop() -> None:
            if self._stop_reason is None:
                self._stop_reason = reason
            event.set()

        with contextlib.suppress(RuntimeError):  # loop closed meanwhile
            loop.call_soon_threadsafe(stop)

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        last_error: OSError | None = None
        for _ in range(20):
            shared_port = 0  # every port-0 address gets the port the first one got
            servers = []
            try:
                for host, port in self.listen:
                    wanted = port or shared_port
                    server = await loop.create_server(
                        lambda: self.session_class(self),
                        host,
                        wanted,
                        reuse_address=True,
                        backlog=1024,
                    )
                    servers.append(server)
                    if not port and not shared_port:
                        shared_port = server.sockets[0].getsockname()[1]
            except OSError as error:
                for server in servers:
                    server.close()
                if error.errno != errno.EADDRINUSE or not shared_port:
                    raise
                last_error = error
                continue
            self._servers = servers
            self.addresses = [s.sockets[0].getsockname()[:2] for s in servers]
            return
        raise OSError(errno.EADDRINUSE, f"no common free port for {self.listen}") from last_error

    async def _shutdown(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        sessions = list(self._sessions)
        for session in sessions:
            if session.transport is not None:
                session.transport.abort()
        deadline = time.monotonic() + 5
        while self._sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        tasks = [s._handler_coroutine for s in sessions if s._handler_coroutine is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        for server in servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)

    def start(self, duration: float | None = None, idle_exit: float | None = None) -> SyntheticPeer:
        """Run in a background thread (its own event loop); returns once listening."""
        if self._thread is not None:
            raise RuntimeError("already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self.serve(duration, idle_exit, on_ready=ready.set))
            except BaseException as error:
                failure.append(error)
            finally:
                ready.set()

        self._thread = threading.Thread(target=run, name="synthetic-peer", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            self._thread.join(5)
            self._thread = None
            raise failure[0]
        return self

    def stop(self, timeout: float = 15.0) -> dict[str, Any]:
        """Stop (if running), join the thread; returns the final report."""
        if self._thread is not None:
            self.request_stop("stopped")
            self._thread.join(timeout)
            self._thread = None
        return self.report()

    def __enter__(self) -> SyntheticPeer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- command line -------------------------------------------------------------------------


def dumps_report(report: dict[str, Any]) -> str:
    """JSON, indented, but one line per timeline/rejection entry (they can be long)."""
    rows = {k: report[k] for k in ("rejections", "timeline") if k in report}
    body = {k: v for k, v in report.items() if k not in rows}
    text = json.dumps(body, indent=2)[: -len("\n}")]
    for key, entries in rows.items():
        lines = ",\n    ".join(json.dumps(e, separators=(",", ":")) for e in entries)
        text += f',\n  "{key}": [' + (f"\n    {lines}\n  ]" if entries else "]")
    return text + "\n}\n"


def write_report(report: dict[str, Any], path: str | None) -> None:
    text = dumps_report(report)
    if not path or path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(target)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="A synthetic large mailbox provider (greylisting, rate limits, "
        "connection caps, silent throttling, blocklist, hard bounces) that reports what it saw.",
        epilog="--time-scale multiplies the greylist window, the rate period, --blocklist-for "
        "and --blocklist-window (not --slow-factor, --duration, --idle-exit).",
    )
    add = parser.add_argument
    add(
        "--listen",
        action="append",
        metavar="IP:PORT",
        help="127.0.0.0/8 only; repeatable "
        "(several MX hosts sharing one state); port 0 = one shared ephemeral port",
    )
    add(
        "--greylist",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="greylist window for new (client IP, sender, recipient) triplets; 0 = off",
    )
    add(
        "--rate",
        metavar="COUNT/PERIOD",
        help="messages (MAIL commands) per client IP, e.g. 100/min, 5/10s; over it: 421",
    )
    add("--burst", type=int, metavar="N", help="GCRA burst (default: the COUNT of --rate)")
    add(
        "--rate-style",
        choices=("gmail", "yahoo"),
        default="gmail",
        help="rate-limit reply: gmail '421 4.7.28 ...' or yahoo '421 4.7.0 [TSS04] ...'",
    )
    add(
        "--max-connections",
        type=int,
        metavar="N",
        help="concurrent connections per client IP; over it: 421 4.7.0 at the greeting",
    )
    add(
        "--slow-banner-at",
        type=int,
        metavar="N",
        help="silent throttling when a client IP has more than N connections open",
    )
    add(
        "--slow-factor",
        type=float,
        default=0.05,
        metavar="SECONDS",
        help="delay per connection over --slow-banner-at, before the banner and every reply "
        "(default 0.05; not time-scaled)",
    )
    add(
        "--blocklist-after",
        type=int,
        metavar="N",
        help="blocklist a client opening more than N connections (or MAILs) within "
        "--blocklist-window after a 421",
    )
    add(
        "--blocklist-throttles",
        type=int,
        metavar="N",
        help="blocklist a client told more than N throttle replies (421) within --blocklist-window",
    )
    add(
        "--blocklist-for",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a client stays blocklisted (550 5.7.1); default 600",
    )
    add(
        "--blocklist-window",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long after a 421 connections/MAILs are counted; default 60",
    )
    add(
        "--bounce",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="answer 550 5.1.1 for this recipient; repeatable",
    )
    add(
        "--bounce-file",
        action="append",
        default=[],
        metavar="FILE",
        help="recipients to bounce, one per line (# comments)",
    )
    add(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="multiply the policy windows by S (0.01: 300 s greylist -> 3 s)",
    )
    add(
        "--duration",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="stop after this long (default 3600)",
    )
    add(
        "--idle-exit",
        type=float,
        metavar="SECONDS",
        help="stop after this long without SMTP traffic, once a message was accepted",
    )
    add("--report", metavar="FILE", help="write the JSON report here (default: stdout)")
    add("--hostname", default="mx.synthetic.test", help="name in the banner and EHLO")
    add("--timeout", type=float, default=300.0, help="idle timeout of an SMTP session")
    add("--no-timeline", action="store_true", help="leave the per-message timeline out")
    add(
        "--start-down",
        action="store_true",
        help="an outage: refuse every connection (421 4.3.2) until SIGUSR1",
    )
    add("--no-uvloop", action="store_true", help="use asyncio's default loop")
    return parser


# Options whose names are SyntheticPeer's keyword arguments as they are.
_SAME_NAMES = (
    *("greylist", "rate", "burst", "rate_style", "max_connections", "slow_banner_at"),
    *("slow_factor", "blocklist_after", "blocklist_throttles", "blocklist_for"),
    *("blocklist_window", "time_scale", "hostname", "timeout"),
)


def peer_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """SyntheticPeer's keyword arguments from build_parser()'s options (parser.error if bad)."""
    if args.duration <= 0:
        parser.error("--duration must be > 0")
    if args.idle_exit is not None and args.idle_exit <= 0:
        parser.error("--idle-exit must be > 0")
    bounces = list(args.bounce)
    try:
        for path in args.bounce_file:
            bounces += read_bounce_file(path)
    except OSError as error:
        parser.error(str(error))
    options = {name: getattr(args, name) for name in _SAME_NAMES}
    options.update(listen=args.listen or ["127.0.0.2:2600"], bounces=bounces)
    return options | {"timeline": not args.no_timeline, "down": args.start_down}


def serve_cli(peer: SyntheticPeer, args: argparse.Namespace) -> int:
    """Run `peer` as the command line does (signals, the report, a summary on stderr)."""

    def announce() -> None:
        where = " ".join(f"{h}:{p}" for h, p in peer.addresses)
        print(f"synthetic_peer: listening on {where}", file=sys.stderr, flush=True)

    async def run() -> str:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, peer.request_stop, f"signal:{sig.name}")
        loop.add_signal_handler(signal.SIGUSR1, peer.come_up)
        return await peer.serve(args.duration, args.idle_exit, on_ready=announce)

    runner = asyncio.run
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            runner = uvloop.run
    try:
        reason = runner(run())
    except OSError as error:
        print(f"synthetic_peer: {error}", file=sys.stderr)
        return 1
    report = peer.report()
    write_report(report, args.report)
    m = report["messages"]
    print(
        f"synthetic_peer: {reason}; accepted {m['accepted']} "
        f"({m['unique_message_ids']} Message-IDs, {m['duplicate_deliveries']} duplicate "
        f"deliveries), 421s {report['replies_421']}, greylisted "
        f"{report['greylist']['deferrals']}, blocklisted {report['blocklist']['listings']}",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = peer_options(parser, args)
    try:
        peer = SyntheticPeer(**options)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    return serve_cli(peer, args)


if __name__ == "__main__":
    sys.exit(main())
