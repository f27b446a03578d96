"""MTA-STS (RFC 8461) and `mtaqueue-ctl dkim check` against software we did not write:
Unbound for the DNS, `openssl s_server -WWW` for the policy files, private Postfix
instances as the receiving MX hosts.

    python bench/mta_sts_unbound.py [--keep]

One Unbound (bench/unbound_instance.py) serves every test zone: each domain's MX and A
records, its `_mta-sts` TXT record, its `mta-sts.DOMAIN` A record and the DKIM key record;
mtaqueue's dns.nameservers points at it. Each policy host is an `openssl s_server -WWW`
on its own loopback address (all on one port: mta_sts.https_port), serving
`.well-known/mta-sts.txt` from its working directory with a certificate for
`mta-sts.DOMAIN` from a test CA (tests/policy_server.py's TestCa) that mtaqueue trusts
through mta_sts.ca_file, the CA it also verifies enforced MX hosts against. The MX hosts
are Postfix instances in receive mode (tests/postfix_instance.py; they accept and discard):
"good" offers STARTTLS with a certificate from the CA for its MX names, "wrong-name" one
from the CA for another name, "other-ca" one for its own name from another CA, "plain" no
STARTTLS. Postfix binds only an address an interface has (127.0.0.1 here), so each
listens on its own port, and each scenario runs its own daemon (this tree's code) with
delivery.port set to its MX host's port.

What happened is read from Postfix's maillog (TLS sessions, accepted recipients), from
s_server's output (one `FILE:` line per fetch), Unbound's query log, mtaqueue's JSON log,
its spool's mta_sts.json and `mtaqueue-ctl list`. Then `mtaqueue-ctl dkim check` with no
key record in Unbound, another key's record, and the record it said to publish (pasted
into Unbound as printed); dkimpy parses the published record and verifies a message
signed by mtaqueue's signer, getting the key from Unbound. Prints a Markdown table; exits
1 if any check fails, 2 without root, Postfix, Unbound or openssl. Loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import smtplib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))  # policy_server.TestCa
sys.path.insert(0, str(REPO))
import dkim  # noqa: E402
import dkim.util  # noqa: E402
import dns.message  # noqa: E402
import dns.query  # noqa: E402
import dns.rdatatype  # noqa: E402
from common import (  # noqa: E402
    dkim_key,
    free_port,
    port_in_use,
    print_checks,
    stop_process,
    work_directory,
)
from policy_server import TestCa, policy_text  # noqa: E402
from postfix_instance import PostfixInstance, postfix_available  # noqa: E402
from postfix_smarthost import Mtaqueue  # noqa: E402
from unbound_instance import UnboundInstance, txt, unbound_available  # noqa: E402

from mtaqueue.config import load  # noqa: E402
from mtaqueue.dkim.keys import load_keys  # noqa: E402
from mtaqueue.dkim.signer import Signer  # noqa: E402

LOCAL = "127.0.0.1"  # Postfix's only bindable loopback address: every MX host is here
DNS_TTL_FLOOR = 5.5  # s: the daemon caches any answer at least 5 s (dnscache.py)
SENDER = "app@sender.test"
BODY = b"From: App <app@sender.test>\r\nSubject: sts\r\n\r\nyour code is 123456\r\n"
DKIM_DOMAIN, SELECTOR = "signed.test", "sel2026"


@dataclass(frozen=True)
class Domain:
    name: str
    mode: str  # the policy's
    receiver: str  # the Postfix instance its MX host is
    policy_ip: str  # its mta-sts host's address (an s_server)
    mx_label: str = "mx"  # its MX host in the DNS: mx_label.name

    @property
    def mx(self) -> str:
        return f"{self.mx_label}.{self.name}"

    @property
    def listed(self) -> str:  # the policy's mx: pattern
        return f"mx.{self.name}"


DOMAINS = [
    Domain("sts-good.test", "enforce", "good", "127.0.0.11"),
    Domain("sts-badname.test", "enforce", "wrong-name", "127.0.0.12"),
    Domain("sts-otherca.test", "enforce", "other-ca", "127.0.0.13"),
    Domain("sts-plain.test", "enforce", "plain", "127.0.0.14"),
    Domain("sts-unlisted.test", "enforce", "good", "127.0.0.15", mx_label="mail"),
    Domain("sts-testing.test", "testing", "wrong-name", "127.0.0.16"),
]
BY_NAME = {d.name: d for d in DOMAINS}


# -- the third-party servers -------------------------------------------------------------------


class PolicyHost:
    """`openssl s_server -WWW` on HOST:PORT, serving files from its own directory: the
    policy at .well-known/mta-sts.txt. Its output has a "FILE:path" line per request."""

    def __init__(self, directory: Path, host: str, port: int, cert: Path, key: Path) -> None:
        self.dir, self.host, self.port = directory, host, port
        self.output = directory.parent / f"{directory.name}.out"
        (directory / ".well-known").mkdir(parents=True)
        with open(self.output, "wb") as out:
            self.proc = subprocess.Popen(
                ["openssl", "s_server", "-WWW", "-accept", f"{host}:{port}",
                 "-cert", str(cert), "-key", str(key)],
                cwd=directory, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 10
        while not port_in_use(host, port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"openssl s_server: {self.output.read_text()}")
            time.sleep(0.05)

    def publish(self, text: str) -> None:
        (self.dir / ".well-known" / "mta-sts.txt").write_text(text, newline="")

    def fetches(self) -> int:
        return self.output.read_text(errors="replace").count("FILE:.well-known/mta-sts.txt")

    def stop(self) -> None:
        stop_process(self.proc, 5)


def sts_record(domain: str, ident: str, *strings: str) -> str:
    """`_mta-sts.DOMAIN` TXT (TTL 1: a restart with a new id is seen once the daemon's
    cache floor has passed); `strings`: the record cut into these character-strings
    instead, as some publishers do ("v=STSv1; " "id=...;"), for the reader to join."""
    name = f"_mta-sts.{domain}."
    if strings:
        return f"{name} 1 IN TXT " + " ".join(f'"{s}"' for s in strings)
    return txt(name, f"v=STSv1; id={ident};", ttl=1)


def first_records() -> dict[str, str]:
    return {d.name: sts_record(d.name, "1") for d in DOMAINS}


def zones(sts: dict[str, str], dkim_record: str | None = None) -> dict[str, list[str]]:
    """Every test zone: per domain its MX, the MX host's A, its `_mta-sts` TXT record
    (`sts`: the zone file lines) and mta-sts.DOMAIN's A; the DKIM zone with
    `dkim_record` (a zone file line)."""
    out: dict[str, list[str]] = {}
    for d in DOMAINS:
        out[d.name] = [
            f"{d.name}. 300 IN MX 10 {d.mx}.",
            f"{d.mx}. 300 IN A {LOCAL}",
            sts[d.name],
            f"mta-sts.{d.name}. 300 IN A {d.policy_ip}",
        ]
    out[DKIM_DOMAIN] = [f"{DKIM_DOMAIN}. 300 IN A {LOCAL}"]
    if dkim_record:
        out[DKIM_DOMAIN].append(dkim_record)
    return out


# -- what Postfix logged -----------------------------------------------------------------------


@dataclass
class Session:
    """One smtpd session, from its "connect from" to its "disconnect from"."""

    tls: str = ""  # once smtpd logged "Anonymous TLS connection established ... TLSv1.3"
    accepted: list[str] = field(default_factory=list)  # recipients discarded (= accepted)
    errors: list[str] = field(default_factory=list)  # SSL_accept errors, lost connections
    commands: str = ""  # the disconnect line's counts: "ehlo=2 starttls=1 mail=1 ..."
    client: str = ""  # the client's IP ("connect from unknown[127.0.0.1]")


_DISCARDED = re.compile(r"/discard\[\d+\]: ([0-9A-F]+): to=<([^>]*)>.*status=sent")
_TLS = re.compile(r"(\w+ TLS) connection established from \S+: (TLSv[\d.]+) with cipher (\S+)")


def sessions(maillog: Path, offset: int) -> list[Session]:
    """The smtpd sessions logged after `offset` (bytes) of the maillog."""
    with open(maillog, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    found: list[Session] = []
    by_pid: dict[str, Session] = {}
    by_queue_id: dict[str, Session] = {}
    for line in lines:
        if m := re.search(r"/smtpd\[(\d+)\]: (.*)$", line):
            pid, text = m[1], m[2]
            if text.startswith("connect from "):
                by_pid[pid] = Session(client=text.rpartition("[")[2].rstrip("]"))
                found.append(by_pid[pid])
                continue
            session = by_pid.get(pid)
            if session is None:
                continue
            if t := _TLS.search(text):
                session.tls = f"{t[1]} {t[2]} {t[3]}"  # "Anonymous TLS TLSv1.3 TLS_AES_..."
            elif q := re.match(r"([0-9A-F]+): client=", text):
                by_queue_id[q[1]] = session
            elif text.startswith("disconnect from "):
                session.commands = text.split(" ", 3)[3] if text.count(" ") >= 3 else ""
            elif "SSL_accept error" in text or text.startswith("lost connection"):
                session.errors.append(re.sub(r" from \S*\[[^\]]*\]", "", text))
        elif (m := _DISCARDED.search(line)) and m[1] in by_queue_id:
            by_queue_id[m[1]].accepted.append(m[2])
    return found


def wait_until(test: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.1)


# -- one scenario ---------------------------------------------------------------------------


@dataclass
class Row:
    number: str
    scenario: str
    mtaqueue: str
    postfix: str
    evidence: str  # policy fetches, DNS queries
    ok: bool


class Bench:
    def __init__(self, workdir: Path, dns: UnboundInstance, ca: TestCa, https_port: int) -> None:
        self.workdir, self.dns, self.ca, self.https_port = workdir, dns, ca, https_port
        self.postfix: dict[str, PostfixInstance] = {}
        self.policy: dict[str, PolicyHost] = {}
        self.sts = first_records()  # each domain's _mta-sts line, as Unbound serves it

    def daemon(self, name: str, receiver: str) -> Mtaqueue:
        return Mtaqueue(
            self.workdir / f"mtaqueue-{name}",
            f'dns.nameservers=["{self.dns.address}"]',
            f"delivery.port={self.postfix[receiver].port}",
            f"mta_sts.ca_file={self.ca.path}",
            f"mta_sts.https_port={self.https_port}",
            config=HERE.parent / "conf" / "mtaqueue.toml",  # the shipped config, its timers
            retry=None,
        )

    def offsets(self) -> dict[str, int]:
        return {name: pf.maillog.stat().st_size for name, pf in self.postfix.items()}

    def queries(self, name: str, kind: str = "TXT") -> int:
        """How many times Unbound was asked for `name`/`kind` (its log-queries lines)."""
        return self.dns.log().count(f" {name}. {kind} IN")

    def send(self, mq: Mtaqueue, rcpt: str) -> None:
        with smtplib.SMTP(LOCAL, mq.port, timeout=30) as client:
            client.sendmail(SENDER, [rcpt], BODY)

    def outcome(self, mq: Mtaqueue, rcpt: str, timeout: float = 30) -> dict:
        """The daemon's first delivery event for `rcpt`."""
        return mq.wait("delivery", timeout, rcpt=rcpt)[0]

    def listed_reason(self, mq: Mtaqueue, domain: str) -> str:
        """`mtaqueue-ctl list --domain` (JSON): the recipient's state and last reply."""
        out = subprocess.run(
            [sys.executable, "-m", "mtaqueue.control.ctl.main", "-s",
             str(mq_spool(mq) / "control.sock"), "list", "--domain", domain, "--json"],
            capture_output=True, text=True, check=True, env=tree_env(),
        ).stdout  # fmt: skip
        rcpts = [r for line in out.splitlines() for r in json.loads(line)["recipients"]]
        return "; ".join(f"{r['state']}: {r['last_reply']}" for r in rcpts) or "not queued"

    # Scenario 1 then 6: the same daemon, so its cache is what a new id must get past.
    def enforce_good_then_new_id(self) -> list[Row]:
        d = BY_NAME["sts-good.test"]
        rows = []
        before, txt_before = self.offsets(), self.queries(f"_mta-sts.{d.name}")
        mq = self.daemon("good", d.receiver)
        try:
            for rcpt in (f"a@{d.name}", f"b@{d.name}"):  # the second goes by the cache
                self.send(mq, rcpt)
                event = self.outcome(mq, rcpt)
            log = self.postfix_wait(d.receiver, before, [f"a@{d.name}", f"b@{d.name}"])
            fetched, state = self.policy[d.name].fetches(), self.sts_state(mq, d.name)
            asked = self.queries(f"_mta-sts.{d.name}") - txt_before
            tls = [s.tls for s in log if s.accepted]
            ok = (
                event["state"] == "delivered"
                and len(tls) >= 1
                and all(tls)
                and sum(len(s.accepted) for s in log) == 2
                and fetched == 1
                and state.get("id") == "1"
                and state.get("mode") == "enforce"
                and asked >= 1
            )
            rows.append(
                Row(
                    "1",
                    "enforce, MX listed, certificate from the CA for its name (2 messages)",
                    f"{event['state']}: {event['code']} {event['text'][:60]}",
                    describe(log),
                    f"policy fetched {fetched}x (s_server FILE: lines); mta_sts.json id="
                    f"{state.get('id')} mode={state.get('mode')}; Unbound: {asked} "
                    f"_mta-sts TXT queries",
                    ok,
                )
            )
            # 6: a new id in the TXT record (Unbound restarted with the new zone; the
            # record in two strings), a new policy file (now a wildcard pattern): fetched
            # again, delivered by it.
            self.sts[d.name] = sts_record(d.name, "2", "v=STSv1; ", "id=2;")
            self.policy[d.name].publish(policy_text("enforce", f"*.{d.name}"))
            self.dns.restart(zones(self.sts))
            time.sleep(DNS_TTL_FLOOR)  # the id 1 record leaves the daemon's cache
            before, txt_before = self.offsets(), self.queries(f"_mta-sts.{d.name}")
            rcpt = f"c@{d.name}"
            self.send(mq, rcpt)
            event = self.outcome(mq, rcpt)
            policy = mq.wait("mta_sts_policy", 10, id="2")[0]
            log = self.postfix_wait(d.receiver, before, [rcpt])
            fetched, state = self.policy[d.name].fetches(), self.sts_state(mq, d.name)
            asked = self.queries(f"_mta-sts.{d.name}") - txt_before
            ok = (
                event["state"] == "delivered"
                and all(s.tls for s in log if s.accepted)
                and fetched == 2
                and state.get("id") == "2"
                and policy["mx"] == [f"*.{d.name}"]
                and asked >= 1
            )
            rows.append(
                Row(
                    "6",
                    'TXT id 1 -> 2 ("v=STSv1; " "id=2;", Unbound restarted with the new '
                    f"zone), new policy (mx: *.{d.name})",
                    f"{event['state']}; mta_sts_policy id={policy['id']} mx={policy['mx']}",
                    describe(log),
                    f"policy fetched {fetched}x in all; mta_sts.json id={state.get('id')}; "
                    f"Unbound (restarted): {asked} _mta-sts TXT queries",
                    ok,
                )
            )
        finally:
            mq.stop()
        return rows

    def deferred(self, number: str, domain: str, scenario: str, connects: bool) -> Row:
        """Scenarios 2-4: enforce with something wrong: deferred, never in clear text.
        `connects`: whether the MX host is connected to at all (not when unlisted)."""
        d = BY_NAME[domain]
        before, txt_before = self.offsets(), self.queries(f"_mta-sts.{d.name}")
        mq = self.daemon(d.receiver + "-" + number, d.receiver)
        rcpt = f"x@{d.name}"
        try:
            self.send(mq, rcpt)
            event = self.outcome(mq, rcpt)
            violation = mq.wait("mta_sts_violation", 10, domain=d.name)[0]
            if connects:  # smtpd's session ends once the client gives up
                self.postfix_wait(d.receiver, before, [], disconnected=1)
            else:
                time.sleep(1)  # time for a connection that should not come
            log = sessions(self.postfix[d.receiver].maillog, before[d.receiver])
            listed = self.listed_reason(mq, d.name)
            fetched = self.policy[d.name].fetches()
            asked = self.queries(f"_mta-sts.{d.name}") - txt_before
        finally:
            mq.stop()
        ok = (
            event["state"] == "deferred"
            and event["kind"] == "tls"
            and not any(s.accepted for s in log)
            and bool(log) == connects
            and not any("mail=" in s.commands for s in log)  # never even got to MAIL
            and violation["action"] in ("deferred", "host skipped")
            and "deferred" in listed
            and fetched == 1
            and asked >= 1
        )
        return Row(
            number,
            scenario,
            f"{event['state']} (kind {event['kind']}); mtaqueue-ctl list: {listed}; "
            f"mta_sts_violation -> {violation['action']}",
            describe(log),
            f"policy fetched {fetched}x; Unbound: {asked} _mta-sts TXT queries",
            ok,
        )

    def testing_bad_certificate(self) -> Row:
        d = BY_NAME["sts-testing.test"]
        before = self.offsets()
        mq = self.daemon("testing", d.receiver)
        rcpt = f"x@{d.name}"
        try:
            self.send(mq, rcpt)
            event = self.outcome(mq, rcpt)
            violation = mq.wait("mta_sts_violation", 10, domain=d.name)[0]
            log = self.postfix_wait(d.receiver, before, [rcpt])
            fetched = self.policy[d.name].fetches()
        finally:
            mq.stop()
        ok = (
            event["state"] == "delivered"
            and violation["action"] == "delivered as usual"
            and any(s.accepted for s in log)
            and fetched == 1
        )
        return Row(
            "5",
            "testing, certificate from the CA for another name",
            f"{event['state']}; mta_sts_violation ({violation['reason']}) -> {violation['action']}",
            describe(log),
            f"policy fetched {fetched}x",
            ok,
        )

    def postfix_wait(
        self,
        receiver: str,
        offsets: dict[str, int],
        rcpts: list[str],
        disconnected: int = 0,
        timeout: float = 30,
    ) -> list[Session]:
        """The sessions since `offsets`, once Postfix logged every one of `rcpts` accepted
        and at least `disconnected` sessions ended (its log is written asynchronously)."""
        maillog, offset = self.postfix[receiver].maillog, offsets[receiver]

        def logged() -> bool:
            log = sessions(maillog, offset)
            accepted = {r for s in log for r in s.accepted}
            ended = sum(1 for s in log if s.commands)
            return set(rcpts) <= accepted and ended >= disconnected

        wait_until(logged, timeout, f"{receiver} Postfix's maillog")
        return sessions(maillog, offset)

    @staticmethod
    def sts_state(mq: Mtaqueue, domain: str) -> dict:
        path = mq_spool(mq) / "mta_sts.json"
        return json.loads(path.read_bytes()).get(domain, {}) if path.exists() else {}


def mq_spool(mq: Mtaqueue) -> Path:
    """The daemon's spool (postfix_smarthost.Mtaqueue puts it in workdir/spool)."""
    for arg in mq.proc.args:  # type: ignore[union-attr]
        if str(arg).startswith("spool.path="):
            return Path(str(arg).partition("=")[2])
    raise RuntimeError("no spool.path")


def tree_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}  # this tree's mtaqueue


def describe(log: list[Session]) -> str:
    """What Postfix's maillog says about these sessions, briefly."""
    if not log:
        return "no connection"
    parts = []
    for s in log:
        tls = s.tls or "no TLS"
        what = f"accepted {', '.join(s.accepted)}" if s.accepted else "nothing accepted"
        errors = f" [{'; '.join(dict.fromkeys(s.errors))}]" if s.errors else ""
        parts.append(f"{tls}, {what}{errors} ({s.commands or 'still open'})")
    counted = {p: parts.count(p) for p in parts}
    return "; ".join(f"{n} x {p}" if n > 1 else p for p, n in counted.items())


# -- dkim check --------------------------------------------------------------------------------


def ctl_dkim(config: Path) -> tuple[int, str, dict]:
    """`mtaqueue-ctl -c CONFIG dkim check DKIM_DOMAIN`: exit code, its text, its JSON row."""

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mtaqueue.control.ctl.main", "-c", str(config),
             "dkim", "check", DKIM_DOMAIN, *extra],
            capture_output=True, text=True, check=False, env=tree_env(),
        )  # fmt: skip

    text, as_json = run(), run("--json")
    (row,) = [json.loads(line) for line in as_json.stdout.splitlines()]
    return text.returncode, (text.stdout + text.stderr).strip(), row


def indent(text: str, workdir: Path) -> str:
    return "\n".join(f"    {line}" for line in text.replace(str(workdir), "WORKDIR").splitlines())


def unbound_txt(dns_server: UnboundInstance) -> Callable[..., bytes]:
    """dkimpy's dnsfunc: the TXT record from Unbound, its strings joined."""

    def dnsfunc(name: bytes, timeout: float = 5) -> bytes:
        query = dns.message.make_query(name.decode(), "TXT", use_edns=0, payload=4096)
        answer = dns.query.udp(query, dns_server.host, port=dns_server.port, timeout=timeout)
        for rrset in answer.answer:
            if rrset.rdtype == dns.rdatatype.TXT:
                return b"".join(rrset[0].strings)
        return b""

    return dnsfunc


def dkim_check(bench: Bench) -> list[Row]:
    key_file = dkim_key(bench.workdir, "rsa-sha256")
    other_dir = bench.workdir / "other-key"
    other_dir.mkdir()
    other_file = dkim_key(other_dir, "rsa-sha256")
    config = bench.workdir / "ctl.toml"
    config.write_text(
        f'[dns]\nnameservers = ["{bench.dns.address}"]\n\n'
        f'[dkim."{DKIM_DOMAIN}"]\nselector = "{SELECTOR}"\nkey_file = "{key_file}"\n'
    )
    name = f"{SELECTOR}._domainkey.{DKIM_DOMAIN}"
    other = f'dkim.{DKIM_DOMAIN}={{selector = "{SELECTOR}", key_file = "{other_file}"}}'
    other_record = load_keys(load(None, [other]).dkim)[DKIM_DOMAIN][0].record()
    rows = []
    asked = bench.queries(name)

    def queried() -> str:
        nonlocal asked
        before, asked = asked, bench.queries(name)
        return f"Unbound: {asked - before} TXT queries for {name}"

    code, text, row = ctl_dkim(config)  # none published
    publish = row["zone_line"]
    print(f"\n`mtaqueue-ctl dkim check {DKIM_DOMAIN}` with no record published (exit {code}):")
    print(indent(text, bench.workdir))
    rows.append(
        Row(
            "7c",
            "dkim check, no key record published",
            f"exit {code}, {row['status']}: {row['detail']}",
            "-",
            queried(),
            code == 1 and row["status"] == "missing",
        )
    )

    bench.dns.restart(zones(bench.sts, txt(f"{name}.", other_record)))
    code, text, row = ctl_dkim(config)
    rows.append(
        Row(
            "7b",
            "dkim check, another key's record published (2 strings)",
            f"exit {code}, {row['status']}: {row['detail']}",
            "-",
            queried(),
            code == 1 and row["status"] == "mismatch",
        )
    )

    bench.dns.restart(zones(bench.sts, publish))  # the line it printed, as printed
    code, text, row = ctl_dkim(config)
    print(f"\nwith that line published in Unbound (exit {code}):")
    print(indent(text, bench.workdir))
    dnsfunc = unbound_txt(bench.dns)
    served = dnsfunc(f"{name}.".encode())
    tags = dkim.util.parse_tag_value(served)
    keys = load_keys(load(config, []).dkim)
    message = BODY.replace(b"sender.test", DKIM_DOMAIN.encode())
    signatures, content = Signer(keys).sign(message, time.time()) or (b"", b"")
    verified = dkim.verify(signatures + content, dnsfunc=dnsfunc)
    strings = len(row["txt"])
    rows.append(
        Row(
            "7a",
            f"dkim check, its own record published (the line it printed, {strings} strings)",
            f"exit {code}, {row['status']}: {row['detail']}",
            "-",
            f"{queried()}; dkimpy: parse_tag_value -> v={tags.get(b'v', b'').decode()} "
            f"k={tags.get(b'k', b'').decode()} p=({len(tags.get(b'p', b''))} chars); "
            f"verifies mtaqueue's signature (key from Unbound): {verified}",
            code == 0
            and row["status"] == "ok"
            and strings > 1
            and tags.get(b"p", b"").decode() == row["record"].rpartition("p=")[2]
            and verified,
        )
    )
    return rows


# -- the run -----------------------------------------------------------------------------------


@contextlib.contextmanager
def servers(workdir: Path, keep: bool) -> Iterator[Bench]:
    """Unbound, the CAs, a policy host per domain, the four Postfix instances."""
    ca, other_ca = TestCa(workdir / "ca"), TestCa(workdir / "other-ca")
    https_port = free_port(DOMAINS[0].policy_ip)
    with contextlib.ExitStack() as stack:
        first = zones(first_records())
        bench = Bench(workdir, stack.enter_context(UnboundInstance(workdir, first)), ca, https_port)
        for d in DOMAINS:
            cert, key = ca.issue(f"mta-sts.{d.name}")
            host = PolicyHost(workdir / "www" / d.name, d.policy_ip, https_port, cert, key)
            stack.callback(host.stop)
            host.publish(policy_text(d.mode, d.listed))
            bench.policy[d.name] = host
        certificates = {
            "good": ca.issue("mx.sts-good.test", "mail.sts-unlisted.test"),
            "wrong-name": ca.issue("wrong.name.test"),
            "other-ca": other_ca.issue("mx.sts-otherca.test"),
            "plain": None,
        }
        for receiver, files in certificates.items():
            for path in files or ():
                path.chmod(0o600)  # smtpd reads them as root, before dropping privileges
            bench.postfix[receiver] = stack.enter_context(
                PostfixInstance(
                    workdir / f"postfix-{receiver}",
                    listen=f"{LOCAL}:{free_port(LOCAL)}",
                    mode="receive",
                    domains=tuple(d.name for d in DOMAINS),
                    tls_cert=files[0] if files else None,
                    tls_key=files[1] if files else None,
                    cleanup=not keep,
                )
            )
        yield bench


def run(workdir: Path, keep: bool) -> list[Row]:
    with servers(workdir, keep) as bench:
        rows = bench.enforce_good_then_new_id()
        rows.append(
            bench.deferred(
                "2", "sts-badname.test", "enforce, certificate from the CA for another name",
                connects=True,
            )
        )  # fmt: skip
        rows.append(
            bench.deferred(
                "2b", "sts-otherca.test", "enforce, certificate for its name from another CA",
                connects=True,
            )
        )  # fmt: skip
        rows.append(
            bench.deferred("3", "sts-plain.test", "enforce, Postfix offers no STARTTLS", True)
        )
        rows.append(
            bench.deferred(
                "4", "sts-unlisted.test",
                "enforce, MX mail.sts-unlisted.test not matching mx: mx.sts-unlisted.test",
                connects=False,
            )
        )  # fmt: skip
        rows.append(bench.testing_bad_certificate())
        rows += dkim_check(bench)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if not (postfix_available() and unbound_available() and shutil.which("openssl")):
        print("needs root, Debian's postfix and unbound packages, openssl", file=sys.stderr)
        return 2
    with work_directory("mtaqueue-sts-", keep=args.keep) as workdir:
        rows = run(workdir, args.keep)
    for r in rows:  # the table goes into RESULTS.md: no path of this machine
        r.mtaqueue = r.mtaqueue.replace(str(workdir), "WORKDIR")
    order = ["1", "2", "2b", "3", "4", "5", "6", "7a", "7b", "7c"]
    rows.sort(key=lambda r: order.index(r.number))
    return print_checks(
        ["scenario", "mtaqueue", "Postfix's maillog", "policy host, Unbound, dkimpy"],
        [(r.number, [r.scenario, r.mtaqueue, r.postfix, r.evidence], r.ok) for r in rows],
    )


if __name__ == "__main__":
    sys.exit(main())
