"""Source pools, warm-up and IPv6/IPv4 fallback against a real Postfix and a real Unbound.

    sudo python bench/postfix_pools.py [--messages 20] [--warmup 5] [--keep]

mtaqueue (this tree's daemon, a subprocess, the shipped conf/mtaqueue.toml with only each
scenario's keys overridden: the pool, delivery.address_order, delivery.port and
dns.nameservers; 3c's pool also its warmup_spread) delivers to a private Postfix 3.7 in
`receive` mode (tests/postfix_instance.py: what it accepts is logged and discarded) on loopback.
The MX, A and AAAA records come from a private Unbound (unbound_instance.py): example.org's
MX has an A record (127.0.0.1), example.net's an A (127.0.0.1) and an AAAA (::1). What
happened is read from Postfix's maillog (the client IPs and HELO names smtpd logged, what
it queued and refused), then compared with what mtaqueue says (its JSON log,
`mtaqueue-ctl domains`, egress.json).

Every scenario runs against a fresh Postfix and a fresh spool:

1. pool: p2's pool is 127.0.0.11 and 127.0.0.12, each with its own HELO name.
2. blocklist: the same pool; Postfix refuses 127.0.0.12 at RCPT with a DNSBL-style reply
   (`check_client_access cidr:`). All mail goes via .11, none bounces, and the hold of
   .12 for that destination shows in `mtaqueue-ctl domains` and egress.json.
3. warm-up: (a) .11 warm and .12 with `warmup = [K, ...]`: at most K messages via .12
   today, the rest via .11; (b) a pool of .12 alone: K go, the rest wait for the next UTC
   day (not bounced, no attempt charged), shown as deferred with the warm-up state;
   (c) the next UTC day comes: the daemon runs under libfaketime, its wall clock started
   LEAD (25) s before a UTC midnight (a relative offset, so that its spool writer and a
   restarted daemon read the same faked time; the monotonic clock, its timers, is real).
   A pool of .12 alone with `warmup = [K, 2K, 4K]`, 3K + 2 messages: K go before the
   faked midnight, the rest wait; after it the ramp is on step 2 (day 1 had no deferral:
   policy/warmup.py `roll` advances it) and 2K of the waiting mail go, in their first
   attempt, within the pool's `warmup_spread` (10 s here; shipped 1h, longer than a bench
   should wait) of midnight; the last 2 wait again, for day 3. A restart after midnight
   keeps the step and the day's count (egress.json, `mtaqueue-ctl domains`). Postfix runs
   on the real clock: its maillog's times are read with the offset added.
4. IPv6: (a) `ipv6-first`, Postfix on IPv4 only: the IPv6 connect is refused and the same
   attempt goes over IPv4; (b) Postfix on both, refusing IPv6 clients with Gmail's
   IPv6/PTR reply -> the destination becomes IPv4-only and the mail goes over IPv4 at
   once. Postfix sends Gmail's reply as its three lines: the access map gives the first
   (after Postfix's own "<unknown[::1]>: Client host rejected: "), its reject footer
   (smtpd_reject_footer_maps) the other two.

Timers: the shipped ones (the retry schedule starts at 5 minutes, so mail delivered within
seconds was not retried). Loopback only (127.0.0.0/8 and ::1). Needs root, Debian's postfix,
unbound and faketime (libfaketime, for 3c) packages; exits 2 without them, 1 if a check
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib.util
import json
import os
import smtplib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # postfix_instance: a private Postfix
from common import free_port, port_in_use, work_directory  # noqa: E402
from postfix_instance import PostfixInstance, postfix_available, received  # noqa: E402
from postfix_smarthost import Mtaqueue  # noqa: E402
from unbound_instance import UnboundInstance, unbound_available  # noqa: E402

SHIPPED = HERE.parent / "conf" / "mtaqueue.toml"
A, B = "127.0.0.11", "127.0.0.12"
HELO = {A: "out1.sender.test", B: "out2.sender.test"}
ZONES = {
    "example.org": [
        "example.org. 300 IN MX 10 mx.example.org.",
        "mx.example.org. 300 IN A 127.0.0.1",
    ],
    "example.net": [
        "example.net. 300 IN MX 10 mx.example.net.",
        "mx.example.net. 300 IN A 127.0.0.1",
        "mx.example.net. 300 IN AAAA ::1",
    ],
}
# A DNSBL refusal as Postfix's reject_rbl_client words it (default_rbl_reply).
BLOCKLIST_TEXT = (
    f"Service unavailable; Client host [{B}] blocked using zen.spamhaus.org;"
    f" https://www.spamhaus.org/query/ip/{B}"
)
# Gmail's three-line reply: the first line from the access map (Postfix puts
# "<unknown[::1]>: Client host rejected: " before any access-map text), the other two as
# its reject footer, sent as further lines of the same reply ("550-5.7.1 ...").
GMAIL_IPV6 = "550 5.7.1 [::1] Our system has detected that this message does"
GMAIL_IPV6_MORE = (
    "not meet IPv6 sending guidelines regarding PTR records and",
    "authentication. https://support.google.com/mail/?p=IPv6AuthError",
)
# Scenario 3c's faked clock: the daemon starts LEAD seconds before this UTC midnight.
MIDNIGHT = datetime(2026, 12, 2, tzinfo=UTC).timestamp()
LEAD = 25.0
DAY = 86400.0
WAKE_SPREAD = 10  # s, its pool's warmup_spread (shipped: 1h, which the bench cannot wait)
PROVIDER_CF = {
    "myhostname": "mx.example.org",
    # Log the accepted RCPTs too ("permit: ... helo=<...>"): smtpd logs HELO names only there.
    "smtpd_log_access_permit_actions": "static:all",
    "smtpd_relay_restrictions": "permit_auth_destination, reject",
}


def libfaketime() -> str | None:
    """Debian's libfaketime (`apt-get install faketime`), or the one the test dependency
    `libfaketime` (pip) carries, if either is installed."""
    spec = importlib.util.find_spec("libfaketime")
    if spec is not None and spec.origin:
        wheel = Path(spec.origin).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
        if wheel.is_file():
            return str(wheel)
    for pattern in (
        "/usr/lib/*/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ):
        if found := sorted(glob.glob(pattern)):
            return found[0]
    return None


def faked_clock(offset: float) -> dict[str, str]:
    """The environment that moves a process's wall clock (time.time(), what the JSON log
    stamps) by `offset` seconds, its children's too (they inherit it): a relative offset,
    so that every process, started when it may, reads the same faked time. The monotonic
    clock (asyncio's timers) is left alone: they run in real seconds."""
    library = libfaketime()
    assert library is not None
    preload = " ".join(filter(None, (library, os.environ.get("LD_PRELOAD"))))
    return {
        "LD_PRELOAD": preload,
        "FAKETIME": f"{offset:+.6f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def stamp(t: float) -> str:
    """A UTC time as the daemon's log has it, to the millisecond: "23:59:35.123"."""
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def logged(event: dict) -> float:
    """The time of a JSON log event (its "timestamp", ISO, UTC)."""
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def pool(*sources: str) -> list[str]:
    """Overrides giving class p2 the pool `bulk` of these source tables."""
    return [f"pools.bulk.sources=[{', '.join(sources)}]", "classes.p2.pool=bulk"]


def source(address: str, warmup: str = "") -> str:
    extra = f", warmup = {warmup}" if warmup else ""
    return f'{{address = "{address}", helo = "{HELO[address]}"{extra}}}'


@dataclass
class Scenario:
    name: str
    workdir: Path
    dns: UnboundInstance
    keep: bool
    ipv6: bool = False  # Postfix listens on [::1] too
    client_access: dict[str, str] = field(default_factory=dict)
    reply_lines: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The daemon's wall clock at its start (libfaketime); None: the real clock.
    fake_start: float | None = None
    offset: float = 0.0  # then the faked clock less the real one (Postfix's)
    rows: list[tuple[str, str, str, bool]] = field(default_factory=list)
    pf: PostfixInstance | None = None
    daemon: Mtaqueue | None = None
    log: dict[str, Any] = field(default_factory=dict)
    _start: Callable[[], Mtaqueue] | None = None

    @contextlib.contextmanager
    def run(self, *overrides: str) -> Iterator[Scenario]:
        """A fresh Postfix (a port free on 127.0.0.1 and ::1 alike: nothing may answer on
        the other family unless asked) and a fresh daemon delivering to it."""
        port = free_port()
        while port_in_use("::1", port):
            port = free_port()
        directory = self.workdir / self.name
        directory.mkdir(mode=0o755)
        self.pf = PostfixInstance(
            directory / "postfix",
            listen=f"127.0.0.1:{port}",
            mode="receive",
            domains=tuple(ZONES),
            also_listen=(f"[::1]:{port}",) if self.ipv6 else (),
            client_access=self.client_access,
            reply_lines=self.reply_lines,
            main_cf=PROVIDER_CF,
            cleanup=not self.keep,
        )
        with self.pf:
            env = {}
            if self.fake_start is not None:
                # A whole real second at the faked midnight: Postfix logs whole seconds.
                real = float(int(time.time() + MIDNIGHT - self.fake_start) + 1)
                self.offset = MIDNIGHT - real
                env = faked_clock(self.offset)
            self._start = functools.partial(
                Mtaqueue,
                directory,
                f'dns.nameservers=["{self.dns.address}"]',
                f"delivery.port={port}",
                *overrides,
                config=SHIPPED,
                retry=None,
                env=env,
            )
            self.daemon = self._start()
            try:
                yield self
            except BaseException:
                for event in self.daemon.events[-8:]:
                    print(f"  mtaqueue: {json.dumps(event)[:300]}")
                raise
            finally:
                self.daemon.stop()
                time.sleep(1)  # postlogd writes asynchronously
                self.log = received(self.pf.maillog)

    def restart(self) -> dict:
        """Stop the daemon, then start it again on the same spool (and faked clock); the
        egress.json the stop left, read in between."""
        assert self.daemon is not None and self._start is not None
        self.daemon.stop()
        saved = self.egress()
        self.daemon = self._start()
        return saved

    def now(self) -> float:
        """The daemon's clock."""
        return time.time() + self.offset

    @property
    def mx(self) -> str:
        assert self.pf is not None
        return f"mx.example.org:{self.pf.port}"

    def submit(self, rcpts: list[str], klass: str = "p2") -> float:
        """One message per recipient, in one session; returns when the last was accepted."""
        assert self.daemon is not None
        with smtplib.SMTP("127.0.0.1", self.daemon.port, timeout=30) as client:
            for rcpt in rcpts:
                body = (
                    f"X-Mtaqueue-Class: {klass}\r\nFrom: app@sender.test\r\nTo: {rcpt}\r\n"
                    f"Subject: {self.name}\r\n\r\nhello\r\n"
                )
                client.sendmail("app@sender.test", [rcpt], body.encode())
        return time.monotonic()

    def delivered(self, count: int, timeout: float = 60) -> list[dict]:
        assert self.daemon is not None
        return self.daemon.wait("delivery", timeout, count=count, outcome="delivered")

    def events(self, name: str, **fields: Any) -> list[dict]:
        assert self.daemon is not None
        return [
            e
            for e in list(self.daemon.events)
            if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())
        ]

    def domains(self) -> dict[str, dict]:
        assert self.daemon is not None
        lines = self.daemon.ctl("domains", "--json").splitlines()
        return {d["destination"]: d for d in map(json.loads, lines)}

    def domains_text(self, destination: str) -> list[str]:
        """`mtaqueue-ctl domains`'s lines for one destination (as people read them)."""
        assert self.daemon is not None
        lines, inside = [], False
        for line in self.daemon.ctl("domains").splitlines():
            if not line.startswith(" "):
                inside = line.split()[0] == destination if line.strip() else False
            if inside:
                lines.append(line)
        return lines

    def egress(self) -> dict:
        """The spool's egress.json (written at the latest when the daemon stops)."""
        assert self.daemon is not None
        path = self.daemon.spool / "egress.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def check(self, what: str, postfix: str, mtaqueue: str, ok: bool) -> None:
        self.rows.append((what, postfix, mtaqueue, ok))
        print(f"  {'ok' if ok else 'FAILED'}: {what}: Postfix: {postfix}; mtaqueue: {mtaqueue}")


def clients(log: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return log.get("clients", {})


def by_client(log: dict[str, Any]) -> str:
    """ "127.0.0.11 (HELO out1.sender.test) 10 msgs, ..." from Postfix's maillog."""
    parts = []
    for ip, c in sorted(clients(log).items()):
        if not (c["messages"] or c["refused"] or c["helo"]):
            continue  # the instance's own start-up check: a greeting, then QUIT
        helo = "/".join(sorted(c["helo"])) or "-"
        refused = f", {c['refused']} refused" if c["refused"] else ""
        parts.append(f"{ip} (HELO {helo}): {c['messages']} msgs{refused}")
    return "; ".join(parts) or "nothing"


def messages_from(log: dict[str, Any], ip: str) -> int:
    return clients(log).get(ip, {}).get("messages", 0)


def not_delivered(s: Scenario) -> list[dict]:
    return [e for e in s.events("delivery") if e.get("outcome") != "delivered"]


# -- the scenarios --------------------------------------------------------------------------


def pool_sources(s: Scenario, n: int) -> None:
    with s.run(*pool(source(A), source(B))):
        s.submit([f"pool{i}@example.org" for i in range(n)])
        s.delivered(n)
    c = clients(s.log)
    helos = all(c.get(ip, {}).get("helo") == {HELO[ip]} for ip in (A, B))
    spread = min(messages_from(s.log, A), messages_from(s.log, B)) > 0
    total = messages_from(s.log, A) + messages_from(s.log, B) == n
    s.check(
        f"1. pool of {A} + {B}, {n} msgs to example.org",
        by_client(s.log),
        f"{n} delivered, {len(not_delivered(s))} not",
        helos and spread and total and not not_delivered(s),
    )


def blocklist(s: Scenario, n: int) -> None:
    s.client_access = {f"{B}/32": f"REJECT {BLOCKLIST_TEXT}"}
    with s.run(*pool(source(A), source(B))):
        s.submit([f"bl{i}@example.org" for i in range(n)])
        done = s.delivered(n)
        listed = s.events("source_blocklisted", source=B)
        shown = s.domains().get(f"{s.mx}@{B}", {})
        text = [line.strip() for line in s.domains_text(f"{s.mx}@{B}") if "excluded" in line]
        messages = s.daemon.ctl("list", "--json").splitlines() if s.daemon else []
    saved = s.egress().get("excluded", {})
    refusals = [t for _, kind, ip, t in s.log["sessions"] if kind == "reject" and ip == B]
    if refusals:
        print(f"  Postfix's reply to {B}: {refusals[0]}")
    if listed:
        print(f"  mtaqueue: source_blocklisted, reply {listed[0]['reply']!r}")
    print(f"  mtaqueue-ctl domains, {s.mx}@{B}: {text}")
    print(f"  egress.json excluded: {saved}")
    ok = (
        messages_from(s.log, A) == n
        and messages_from(s.log, B) == 0
        and bool(refusals)
        and all("blocked using zen.spamhaus.org" in r for r in refusals)
        and len(listed) == 1
        and bool(shown.get("source_excluded_until"))
        and f"{s.mx}@{B}" in saved
        and not not_delivered(s)
        and all(e["attempt"] == 1 for e in done)  # the refused went on at once, uncharged
        and not messages
    )
    s.check(
        f"2. {B} refused at RCPT with a DNSBL reply, {n} msgs",
        by_client(s.log),
        f"source_blocklisted {B} (kind blocklist), {n} delivered via {A} in attempt 1, "
        f"{len(not_delivered(s))} bounced or deferred, hold in ctl domains and egress.json: "
        f"{bool(shown.get('source_excluded_until')) and f'{s.mx}@{B}' in saved}",
        ok,
    )


def warmup_beside_warm(s: Scenario, n: int, k: int) -> None:
    schedule = f"[{k}, {10 * k}, {100 * k}]"
    with s.run(*pool(source(A), source(B, schedule))):
        s.submit([f"warm{i}@example.org" for i in range(n)])
        s.delivered(n)
        ramp = s.domains().get(f"{s.mx}@{B}", {}).get("warmup") or {}
        text = [line.strip() for line in s.domains_text(f"{s.mx}@{B}") if "warm-up" in line]
    print(f"  mtaqueue-ctl domains, {s.mx}@{B}: {text}")
    via_b = messages_from(s.log, B)
    ok = (
        1 <= via_b <= k
        and messages_from(s.log, A) == n - via_b
        and ramp.get("sent_today") == via_b
        and ramp.get("allowance") == k
        and not not_delivered(s)
    )
    s.check(
        f"3a. {B} warming ({schedule}) beside warm {A}, {n} msgs",
        by_client(s.log),
        f"warm-up step {ramp.get('step')}/{ramp.get('steps')}, sent today"
        f" {ramp.get('sent_today')} of {ramp.get('allowance')}; {n} delivered",
        ok,
    )


def warmup_alone(s: Scenario, n: int, k: int) -> None:
    schedule = f"[{k}, {10 * k}]"
    with s.run(*pool(source(B, schedule))):
        s.submit([f"cold{i}@example.org" for i in range(n)])
        s.delivered(k)
        assert s.daemon is not None
        waits = s.daemon.wait("warmup_wait", 60, count=n - k)
        time.sleep(1)  # nothing more may leave
        shown = s.domains().get(f"{s.mx}@{B}", {})
        text = [line.strip() for line in s.domains_text(f"{s.mx}@{B}")]
        queue = [json.loads(m) for m in s.daemon.ctl("list", "--json").splitlines()]
        listed = s.daemon.ctl("list").splitlines()
    print(f"  mtaqueue-ctl domains, {s.mx}@{B}:")
    for line in text:
        print(f"    {line}")
    print(f"  mtaqueue-ctl list: {len(listed) - 1} lines, the first message's:")
    for line in listed[:2]:
        print(f"    {line}")
    rcpts = [r for m in queue for r in m["recipients"]]
    states = sorted({r["state"] for r in rcpts})
    ramp = shown.get("warmup") or {}
    tomorrow = int(time.time() // 86400) + 1
    ok = (
        messages_from(s.log, B) == k
        and sum(c["messages"] for c in clients(s.log).values()) == k
        and len({w["id"] for w in waits}) == n - k
        and all(int(w["until"] // 86400) == tomorrow for w in waits)
        and len(queue) == n - k
        # Never attempted: the wait for the allowance is none, and it is the scheduler's
        # (in memory), so the spool's record shows no next attempt.
        and states == ["queued"]
        and all(r["attempts"] == 0 for r in rcpts)  # waiting for the allowance is no attempt
        and ramp.get("sent_today") == k
        and shown.get("deferred") == {"p2": n - k}
        and not not_delivered(s)
        and not s.events("dsn_queued")
    )
    s.check(
        f"3b. pool of {B} alone, warming ({schedule}), {n} msgs",
        by_client(s.log),
        f"{k} delivered, {len(queue)} waiting (warmup_wait until the next UTC day; ctl list:"
        f" {'/'.join(states)}, 0 attempts; ctl domains: deferred {shown.get('deferred')},"
        f" sent today {ramp.get('sent_today')} of {ramp.get('allowance')}), 0 bounced",
        ok,
    )


def writer_faked(daemon: Mtaqueue) -> bool:
    """Whether the daemon's children (the spool writer) run with libfaketime loaded."""
    children = [p for p in Path("/proc").glob("[0-9]*") if _parent(p) == daemon.proc.pid]
    try:
        return bool(children) and all(
            "libfaketime" in (p / "maps").read_text()
            and b"FAKETIME=" in (p / "environ").read_bytes()
            for p in children
        )
    except OSError:
        return False


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def warmup_next_day(s: Scenario, n: int, k: int) -> None:
    """N = 3K + 2 messages before the faked midnight: K go on day 1 (step 1), then 2K on
    day 2 (step 2: a day with no deferrals advances the ramp, policy/warmup.py `roll`), and
    the last 2 wait again, for day 3; a restart keeps day 2's step and count. The last
    message is p1 (the others p2), sent once the rest wait: the youngest, it goes on day 2
    (the allowance goes by class first), as Postfix's log shows by its Message-ID."""
    schedule = f"[{k}, {2 * k}, {4 * k}]"
    s.fake_start = MIDNIGHT - LEAD
    spread = f'pools.bulk.warmup_spread="{WAKE_SPREAD}s"'
    with s.run(*pool(source(B, schedule)), "classes.p1.pool=bulk", spread):
        assert s.daemon is not None
        ready = logged(s.daemon.wait("ready", 5)[0])
        clock_ok = abs(ready - (MIDNIGHT - LEAD)) < 10 and abs(ready - s.now()) < 5
        child_ok = writer_faked(s.daemon)
        print(
            f"  daemon's clock (libfaketime, offset {s.offset:+.0f} s): ready at"
            f" {datetime.fromtimestamp(ready, UTC):%Y-%m-%d %H:%M:%S} UTC; the spool"
            f" writer faked too: {child_ok}"
        )
        s.submit([f"day{i}@example.org" for i in range(n - 1)])
        day1 = s.delivered(k)
        s.daemon.wait("warmup_wait", 60, count=n - 1 - k)
        s.submit(["alert@example.org"], klass="p1")
        waits = s.daemon.wait("warmup_wait", 60, count=n - k)
        time.sleep(1)  # nothing more may leave
        key = f"{s.mx}@{B}"
        before = s.domains().get(key, {})
        queue = [json.loads(m) for m in s.daemon.ctl("list", "--json").splitlines()]
        looked = s.now()
        wait_text = [line.strip() for line in s.domains_text(key) if "warm-up" in line]
        print(f"  {stamp(looked)}: mtaqueue-ctl domains, {key}: {wait_text}")
        wakes = ", ".join(f"{w['until'] - MIDNIGHT:.1f}" for w in waits)
        print(f"  warmup_wait until, in s after midnight: {wakes}")
        # Day 2: the waiting mail comes back within the spread, and 2K of it goes.
        left = MIDNIGHT + WAKE_SPREAD - s.now()
        everything = s.delivered(3 * k, timeout=left + 60)
        again = s.daemon.wait("warmup_wait", 30, count=n - k + (n - 3 * k))
        time.sleep(1)
        after = s.domains().get(key, {})
        after_text = [line.strip() for line in s.domains_text(key) if "warm-up" in line]
        print(f"  {stamp(s.now())}: mtaqueue-ctl domains, {key}: {after_text}")
        first = s.events("delivery")
        advanced = s.events("warmup_advanced")
        held = s.events("warmup_held")
        dsns = s.events("dsn_queued")
        # A restart after midnight: day 2's step and count come back from egress.json.
        saved = s.restart().get("warmup", {}).get(key, {})
        restarted = s.domains().get(key, {})
        again_text = [line.strip() for line in s.domains_text(key) if "warm-up" in line]
        print(f"  egress.json at the restart: {key}: {saved}")
        print(f"  {stamp(s.now())}, restarted: mtaqueue-ctl domains: {again_text}")
        waited = s.daemon.wait("warmup_wait", 90, count=n - 3 * k)
        wakes = ", ".join(
            f"{stamp(logged(w))} until +1 day {w['until'] - MIDNIGHT - DAY:.1f} s" for w in waited
        )
        print(f"  after the restart, warmup_wait: {wakes}")
        time.sleep(1)
        later = s.events("delivery")
        remaining = [json.loads(m) for m in s.daemon.ctl("list", "--json").splitlines()]
    real = MIDNIGHT - s.offset
    queued = [t for t, kind, ip, _ in s.log["sessions"] if kind == "queued" and ip == B]
    pf_before = [t for t in queued if t < real]
    pf_after = [t for t in queued if t >= real]
    day2 = [e for e in everything if e not in day1]
    rewaits = [w for w in again if w not in waits]

    def span(times: list[float], digits: int = 12) -> str:
        return f"{stamp(min(times))[:digits]}-{stamp(max(times))[:digits]}" if times else "-"

    print(
        f"  Postfix's maillog, {B}'s messages: {len(pf_before)} at {span(pf_before)} real ="
        f" {span([t + s.offset for t in pf_before])} faked, {len(pf_after)} at"
        f" {span(pf_after)} = {span([t + s.offset for t in pf_after])} faked"
    )
    print(
        f"  mtaqueue's log (faked): {len(day1)} delivered at {span([logged(e) for e in day1])},"
        f" {len(day2)} at {span([logged(e) for e in day2])}"
    )
    for e in advanced + held:
        fields = ("step", "allowance", "sent", "deferred", "rate", "previous_rate")
        shown = ", ".join(f"{f}={e.get(f)}" for f in fields)
        print(f"  {stamp(logged(e))}: {e['event']} {e['source']} at {e['base']}: {shown}")
    ramp0, ramp1, ramp2 = (d.get("warmup") or {} for d in (before, after, restarted))
    rcpts = [r for m in queue for r in m["recipients"]]
    left_over = [r for m in remaining for r in m["recipients"]]
    alert = next((m["id"] for m in queue if m["class"] == "p1"), "")
    alert_at = [t for t, mid in s.log["accepted"] if mid.startswith(f"<{alert}@")]
    print(f"  Postfix's log: the p1 message <{alert}@...> at {span(alert_at)} real")
    alert_day2 = len(alert_at) == 1 and real <= alert_at[0] <= real + WAKE_SPREAD + 30
    ok = (
        clock_ok
        and child_ok
        and len(pf_before) == k
        and len(pf_after) == 2 * k
        and messages_from(s.log, B) == 3 * k
        and sum(c["messages"] for c in clients(s.log).values()) == 3 * k
        # Day 1: K delivered before midnight, the rest waiting, uncharged, for day 2.
        and all(logged(e) < MIDNIGHT for e in day1)
        and looked < MIDNIGHT
        and len({w["id"] for w in waits}) == n - k
        and all(MIDNIGHT <= w["until"] <= MIDNIGHT + WAKE_SPREAD for w in waits)
        and (ramp0.get("step"), ramp0.get("allowance"), ramp0.get("sent_today")) == (1, k, k)
        and len(queue) == n - k
        and all(r["attempts"] == 0 for r in rcpts)
        # Day 2: step 2 (no deferral on day 1), 2K go in their first attempt, 2 wait again.
        and all(MIDNIGHT <= logged(e) <= MIDNIGHT + WAKE_SPREAD + 30 for e in day2)
        and len(day2) == 2 * k
        and all(e["attempt"] == 1 for e in everything)
        and len(advanced) == 1
        and (advanced[0]["step"], advanced[0]["allowance"]) == (2, 2 * k)
        and (advanced[0]["sent"], advanced[0]["deferred"]) == (k, 0)
        and not held
        and len({w["id"] for w in rewaits}) == n - 3 * k
        and all(MIDNIGHT + DAY <= w["until"] <= MIDNIGHT + DAY + WAKE_SPREAD for w in rewaits)
        and (ramp1.get("step"), ramp1.get("allowance"), ramp1.get("sent_today"))
        == (2, 2 * k, 2 * k)
        and ramp1.get("deferred_today") == 0
        # The restart: the same step and count (egress.json), the 2 wait for day 3.
        and (saved.get("step"), saved.get("sent"), saved.get("deferred")) == (1, 2 * k, 0)
        and saved.get("day") == int(MIDNIGHT // DAY)
        and (ramp2.get("step"), ramp2.get("sent_today")) == (2, 2 * k)
        and all(MIDNIGHT + DAY <= w["until"] <= MIDNIGHT + DAY + WAKE_SPREAD for w in waited)
        and not later
        and len(remaining) == n - 3 * k
        and all(r["attempts"] == 0 for r in left_over)
        and alert_day2  # the youngest, yet on day 2
        and len(first) == 3 * k
        and not [e for e in first if e.get("outcome") != "delivered"]
        and not dsns
    )
    s.check(
        f"3c. pool of {B} alone, warming ({schedule}), {n} msgs before a faked UTC midnight",
        f"{len(pf_before)} msgs from {B} before midnight (at"
        f" {span([t + s.offset for t in pf_before], 8)} faked), {len(pf_after)} after (at"
        f" {span([t + s.offset for t in pf_after], 8)}); {by_client(s.log)}",
        f"day 1: step {ramp0.get('step')}, {ramp0.get('sent_today')} of"
        f" {ramp0.get('allowance')} sent, {len(queue)} waiting (0 attempts); day 2:"
        f" warmup_advanced to step {ramp1.get('step')}, {len(day2)} delivered in attempt 1"
        f" within {WAKE_SPREAD} s of midnight, {ramp1.get('sent_today')} of"
        f" {ramp1.get('allowance')} sent, the p1 one {'' if alert_day2 else 'not '}among"
        f" them (Postfix's log), {len(rewaits)} waiting for day 3; after a restart:"
        f" step {ramp2.get('step')}, sent today {ramp2.get('sent_today')}, nothing more"
        f" sent; 0 bounced",
        ok,
    )


def ipv6_unreachable(s: Scenario, n: int) -> None:
    with s.run("delivery.address_order=ipv6-first"):
        start = s.submit([f"six{i}@example.net" for i in range(n)], klass="p1")
        done = s.delivered(n)
        elapsed = time.monotonic() - start
    sessions = [(kind, ip) for _, kind, ip, _ in s.log["sessions"] if ip != "127.0.0.1"]
    queries = [line for line in s.dns.log().splitlines() if "mx.example.net. A" in line]
    print("  Unbound's log:", *(q.split("] ", 1)[-1] for q in queries[-2:]), sep="\n    ")
    asked = any(" AAAA IN" in line for line in queries)
    ok = (
        messages_from(s.log, "127.0.0.1") == n
        and not [ip for _, ip in sessions if ip == "::1"]
        and all(e["attempt"] == 1 and e["ip"] == "127.0.0.1" for e in done)
        and elapsed < 10
        and asked
    )
    s.check(
        f"4a. ipv6-first, AAAA ::1 + A 127.0.0.1, Postfix on IPv4 only, {n} msgs",
        by_client(s.log) + " (nothing listens on [::1])",
        f"{n} delivered over 127.0.0.1 in attempt 1, {elapsed:.1f} s after submission",
        ok,
    )


def ipv6_refused(s: Scenario, n: int) -> None:
    s.ipv6 = True
    s.client_access = {"::1/128": GMAIL_IPV6}
    s.reply_lines = {r"\[::1\] Our system has detected": GMAIL_IPV6_MORE}
    with s.run("delivery.address_order=ipv6-first"):
        start = s.submit(["first@example.net"], klass="p1")
        (first,) = s.delivered(1)
        elapsed = time.monotonic() - start
        refused = s.events("ipv6_refused")
        s.submit([f"later{i}@example.net" for i in range(n)], klass="p1")
        s.delivered(n + 1)
        net = f"mx.example.net:{s.pf.port}" if s.pf else ""
        ipv4_only = s.domains().get(net, {}).get("ipv4_only")
        text = [line.strip() for line in s.domains_text(net) if "families" in line]
    saved = s.egress().get("ipv4_only", {})
    if refused:
        print(f"  mtaqueue: ipv6_refused, reply {refused[0]['reply']!r}")
    print(f"  mtaqueue-ctl domains, {net}: {text}; egress.json ipv4_only: {list(saved)}")
    sessions = s.log["sessions"]
    at = next((i for i, (_, kind, _ip, _t) in enumerate(sessions) if kind == "reject"), None)
    after = sessions[at + 1 :] if at is not None else []
    print("  Postfix's maillog around the refusal:")
    for _, kind, ip, reply in sessions[max((at or 0) - 1, 0) : (at or 0) + 3]:
        print(f"    {kind} from {ip}{': ' + reply if reply else ''}")
    ok = (
        len(refused) == 1
        and at is not None
        and sessions[at][2] == "::1"
        and "Our system has detected" in sessions[at][3]  # smtpd logs the first line only
        and " / ".join(GMAIL_IPV6_MORE) in refused[0]["reply"]  # mtaqueue got all three
        and [(k, ip) for _, k, ip, _t in after[:2]]
        == [("connect", "127.0.0.1"), ("queued", "127.0.0.1")]
        and messages_from(s.log, "::1") == 0
        and not [ip for _, _k, ip, _t in after if ip == "::1"]  # later mail: IPv4 only
        and messages_from(s.log, "127.0.0.1") == n + 1
        and first["attempt"] == 1
        and first["ip"] == "127.0.0.1"
        and elapsed < 10
        and ipv4_only is True
        and net in saved
        and not not_delivered(s)
    )
    s.check(
        f"4b. ipv6-first, Postfix on both, IPv6 refused (Gmail's PTR text), 1 + {n} msgs",
        by_client(s.log),
        f"ipv6_refused; the first delivered over IPv4 in attempt 1, {elapsed:.1f} s after"
        f" submission; then IPv4 only (ctl domains, egress.json); {n + 1} delivered",
        ok,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20, help="per scenario (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="K, the first day's allowance")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if not postfix_available() or not unbound_available() or libfaketime() is None:
        print("needs root and Debian's postfix, unbound and faketime packages", file=sys.stderr)
        return 2
    n, k = args.messages, args.warmup
    scenarios: list[tuple[str, Callable[[Scenario], None]]] = [
        ("pool", lambda s: pool_sources(s, n)),
        ("blocklist", lambda s: blocklist(s, n)),
        ("warmup", lambda s: warmup_beside_warm(s, n, k)),
        ("warmup-alone", lambda s: warmup_alone(s, max(n // 2, k + 1), k)),
        ("warmup-next-day", lambda s: warmup_next_day(s, 3 * k + 2, k)),
        ("ipv6-down", lambda s: ipv6_unreachable(s, 3)),
        ("ipv6-refused", lambda s: ipv6_refused(s, 3)),
    ]
    rows: list[tuple[str, str, str, bool]] = []
    with (
        work_directory("postfix-pools-", keep=args.keep) as workdir,
        UnboundInstance(workdir, ZONES) as dns,
    ):
        print(f"Unbound on {dns.address}; timers: the shipped ones (conf/mtaqueue.toml)")
        for name, body in scenarios:
            print(f"\n== {name} ==", flush=True)
            scenario = Scenario(name, workdir, dns, args.keep)
            try:
                body(scenario)
            except (TimeoutError, RuntimeError, AssertionError) as exc:
                scenario.check(name, by_client(scenario.log), f"{type(exc).__name__}: {exc}", False)
            rows += scenario.rows
    print("\n| scenario | Postfix's maillog (client, HELO, messages queued) | mtaqueue | check |")
    print("| --- | --- | --- | --- |")
    for what, postfix, mtaqueue, ok in rows:
        print(f"| {what} | {postfix} | {mtaqueue} | {'✓' if ok else '✗'} |")
    failed = [row for row in rows if not row[3]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks pass", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
