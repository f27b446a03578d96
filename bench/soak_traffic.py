"""The receivers, the DNS and the submitter of bench/soak.py (issue 31).

Every MX host is its own loopback address on one shared port (the daemon's delivery.port):

    mx.sink.test   127.0.0.21  smtp-sink -c -D (Postfix's), every d<N>.accept.test
    mx.grey.test   127.0.0.22  synthetic peer: greylists each new triplet once (60 s)
    mx.bounce.test 127.0.0.23  synthetic peer: 550 5.1.1 for bad<N>@bounce.test
    mx.down.test   127.0.0.24  synthetic peer: down (421 at connect) every other minute
    mx.slow.test   127.0.0.25  synthetic peer: every reply a second late
    mx.app.test    127.0.0.26  the senders' domain: counts the DSNs, by the keys they quote

Unbound serves the zones; accept.test is a `redirect` zone, so every d<N>.accept.test has
the MX of accept.test.
"""

from __future__ import annotations

import contextlib
import re
import smtplib
import threading
import time
from collections import Counter
from pathlib import Path

from common import free_port
from postfix_tools import SmtpSink, port_free
from synthetic_peer import SyntheticPeer
from unbound_instance import UnboundInstance

HOSTS = {"sink": 21, "grey": 22, "bounce": 23, "down": 24, "slow": 25, "app": 26}
SENDER = "app@app.test"
KEY = re.compile(rb"<(s\d+)@soak\.test>")
GREYLIST_S = 60


def ip(name: str) -> str:
    return f"127.0.0.{HOSTS[name]}"


def zones() -> tuple[dict[str, list[str]], dict[str, str]]:
    records = {"accept.test": ["accept.test. 300 IN MX 10 mx.sink.test."]}
    for name in HOSTS:
        records[f"{name}.test"] = [f"mx.{name}.test. 300 IN A {ip(name)}"]
        if name != "sink":
            records[f"{name}.test"].append(f"{name}.test. 300 IN MX 10 mx.{name}.test.")
    return records, {"accept.test": "redirect"}


def recipients(i: int, suppressed: str | None) -> tuple[list[str], str]:
    """Message i's recipients and its kind: 65% accept (a new domain each), 10% grey,
    10% bounce (half of them with one bad recipient too), 10% down, 5% slow; every 100th
    goes to the address suppressed last (the daemon should refuse it)."""
    slot = i % 20
    if i % 100 == 50 and suppressed:
        return [suppressed], "suppressed"
    if slot < 13:
        return [f"u{i}@d{i}.accept.test"], "accept"
    if slot < 15:
        return [f"g{i}@grey.test"], "grey"
    if slot < 17:
        bad = [f"bad{i}@bounce.test"] if slot == 15 else []
        return [f"ok{i}@bounce.test", *bad], "bounce"
    if slot < 19:
        return [f"w{i}@down.test"], "down"
    return [f"s{i}@slow.test"], "slow"


class _Slow(SyntheticPeer):
    def _delay(self, client) -> float:  # every reply, whatever the load
        return 1.0


class _DsnSink(SyntheticPeer):
    """Accepts everything; counts the soak keys each DSN quotes (the original's Message-ID)."""

    def _on_data(self, session, envelope) -> str:
        keys = {k.decode() for k in KEY.findall(envelope.original_content or b"")}
        self.dsn_keys.update(keys)
        return super()._on_data(session, envelope)


class Receivers:
    """The sinks, the peers and Unbound, on a port free on every MX address."""

    def __init__(self, workdir: Path, bad: list[str]) -> None:
        self.workdir = workdir
        while True:
            self.port = free_port(ip("sink"))
            if all(port_free(ip(n), self.port) for n in HOSTS):
                break
        dump = workdir / "sink-dump"
        dump.mkdir()
        import shutil

        shutil.chown(dump, "nobody")
        self.dump = dump / "sink"
        self.sink = SmtpSink(f"{ip('sink')}:{self.port}", 200, ("-D", str(self.dump)))
        at = {n: [f"{ip(n)}:{self.port}"] for n in HOSTS}
        self.grey = SyntheticPeer(at["grey"], greylist=GREYLIST_S, hostname="mx.grey.test")
        self.bounce = SyntheticPeer(at["bounce"], bounces=bad, hostname="mx.bounce.test")
        self.down = SyntheticPeer(at["down"], hostname="mx.down.test")
        self.slow = _Slow(at["slow"], slow_banner_at=0, slow_factor=1.0, hostname="mx.slow.test")
        self.dsn = _DsnSink(at["app"], hostname="mx.app.test")
        self.dsn.dsn_keys = Counter()
        self.peers = [self.grey, self.bounce, self.down, self.slow]
        records, kinds = zones()
        self.dns = UnboundInstance(workdir, records, kinds=kinds)

    def __enter__(self) -> Receivers:
        self.dns.start()
        self.sink.start()
        for peer in (*self.peers, self.dsn):
            peer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for peer in (*self.peers, self.dsn):
            peer.stop()
        self.sink.stop()
        self.dns.stop()

    def flip_down(self) -> None:
        """The down domain's MX goes down (421 at connect) or comes back."""
        if self.down.down:
            self.down.come_up()
        else:
            self.down.down = True

    def delivered(self) -> int:
        return self.sink.count() + sum(p.accepted for p in self.peers)

    def dsns(self) -> int:
        return self.dsn.accepted

    def delivered_keys(self) -> Counter:
        """Key -> transactions that delivered it, at every sink but the DSNs'."""
        seen: Counter = Counter()
        if self.dump.exists():
            with open(self.dump, "rb") as f:
                for line in f:
                    if line[:11].lower() == b"message-id:" and (m := KEY.search(line)):
                        seen[m[1].decode()] += 1
        for peer in self.peers:
            for _t, mid, *_ in list(peer._timeline):
                if mid and (m := KEY.search(mid.encode())):
                    seen[m[1].decode()] += 1
        return seen


class Submitter:
    """`threads` SMTP clients sending message i at start + i / rate until `end` (monotonic),
    retrying a 4xx or a lost connection with the same key (the idempotency key dedupes)."""

    def __init__(self, port: int, rate: float, end: float, threads: int = 8) -> None:
        self.port, self.rate, self.end = port, rate, end
        self.start = time.monotonic()
        self.next = 0
        self.lock = threading.Lock()
        self.acked: dict[str, list[str]] = {}  # key -> recipients accepted
        self.kinds: Counter = Counter()
        self.refused: Counter = Counter()  # permanent refusals (5xx), by kind
        self.retries = 0
        self.suppressed: str | None = None
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    @property
    def submitted(self) -> int:
        return self.next

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def _take(self) -> int | None:
        with self.lock:
            i = self.next
            due = self.start + i / self.rate
            if due >= self.end or time.monotonic() >= self.end:
                return None  # the end, even when behind (a daemon slower than the rate)
            self.next += 1
        time.sleep(max(0.0, due - time.monotonic()))
        return i

    def _run(self) -> None:
        client: smtplib.SMTP | None = None
        while (i := self._take()) is not None:
            key = f"s{i}"
            rcpts, kind = recipients(i, self.suppressed)
            body = "x" * 70 + "\r\n"
            msg = (
                f"From: <{SENDER}>\r\nTo: <{rcpts[0]}>\r\nSubject: soak {i} {kind}\r\n"
                f"Message-ID: <{key}@soak.test>\r\nX-Mtaqueue-Idempotency-Key: {key}\r\n"
                f"\r\n" + body * 8
            ).encode()
            while True:
                try:
                    if client is None:
                        client = smtplib.SMTP("127.0.0.1", self.port, timeout=60)
                    refused = client.sendmail(SENDER, rcpts, msg)
                    with self.lock:
                        self.acked[key] = [r for r in rcpts if r not in refused]
                        self.kinds[kind] += 1
                    break
                except smtplib.SMTPRecipientsRefused as exc:
                    codes = [code for code, _ in exc.recipients.values()]
                    if all(code >= 500 for code in codes):
                        with self.lock:
                            self.refused[kind] += 1
                        break
                    client = self._retry(client, f"{codes}")
                except smtplib.SMTPResponseException as exc:
                    if exc.smtp_code >= 500:
                        with self.lock:
                            self.refused[kind] += 1
                            self.errors.append(f"{key}: {exc.smtp_code} {exc.smtp_error!r}")
                        break
                    client = self._retry(client, f"{exc.smtp_code}")
                except (OSError, smtplib.SMTPException) as exc:
                    client = self._retry(client, repr(exc))
        if client is not None:
            with contextlib.suppress(OSError, smtplib.SMTPException):
                client.quit()

    def _retry(self, client: smtplib.SMTP | None, why: str) -> None:
        with self.lock:
            self.retries += 1
            if len(self.errors) < 50:
                self.errors.append(f"retried: {why}")
        if client is not None:
            with contextlib.suppress(OSError):
                client.close()
        time.sleep(1)
        return None
