"""mtaqueue's class relay against a real smarthost: a private Postfix with Cyrus SASL that takes
mail only over TLS and only after AUTH, as an ESP's submission port does.

    sudo python bench/postfix_smarthost.py [--messages 5] [--mode starttls|implicit|both]

For each mode, a private Postfix (tests/postfix_instance.py, receive mode: what it accepts is
logged and discarded) on 127.0.0.1 with smtpd_tls_security_level = encrypt,
smtpd_tls_auth_only = yes and permit_sasl_authenticated as its only relay permission, users
in a sasldb (saslpasswd2; PLAIN and LOGIN): "starttls" is a 587-style port, "implicit" a
465-style one (smtpd_tls_wrappermode). mtaqueue (this tree) runs with classes.p0.relayhost
pointed at it, relay_user, relay_password_file and relay_tls_ca (Postfix's self-signed
certificate, made for the address 127.0.0.1).

First a wrong password: the p0 message is deferred (not bounced), mtaqueue logs
relay_auth_failed and Postfix "authentication failed"; the right password and a SIGHUP send
it. Then MESSAGES p0 messages, each to recipients in two domains. The script prints
Postfix's log lines for the TLS sessions, the logins and what it accepted, and checks that
every message arrived with sasl_username=acct over TLS. Needs root (Postfix's master) and
sasl2-bin (saslpasswd2); exits 2 when they are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import shutil
import signal
import smtplib
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # postfix_instance: a private Postfix
from common import free_port, stop_process, work_directory  # noqa: E402
from postfix_instance import TLSMGR, PostfixInstance, postfix_available  # noqa: E402

# Postfix binds only addresses an interface has (lo: 127.0.0.1), on a free port.
SMARTHOST = "127.0.0.1"
USER, PASSWORD, REALM = "acct", "s3cret-relay", "smarthost.test"
SASLPASSWD2 = "/usr/sbin/saslpasswd2"


def make_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "smarthost.crt", directory / "smarthost.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "2", "-subj", f"/CN={REALM}",
         "-addext", f"subjectAltName=DNS:{REALM},IP:{SMARTHOST}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    cert.chmod(0o644)
    key.chmod(0o600)  # smtpd reads it as root, before it drops privileges
    return cert, key


def make_sasldb(directory: Path) -> Path:
    """A sasldb with USER in REALM."""
    directory.mkdir(mode=0o755)
    db = directory / "sasldb2"
    subprocess.run(
        [SASLPASSWD2, "-p", "-c", "-f", str(db), "-u", REALM, USER],
        input=PASSWORD.encode(), check=True, capture_output=True,
    )  # fmt: skip
    postfix = pwd.getpwnam("postfix")
    os.chown(db, 0, postfix.pw_gid)
    db.chmod(0o640)  # smtpd (the postfix user) reads it at each AUTH
    return db


def finish_setup(pf: PostfixInstance, db: Path, mode: str) -> None:
    """Point smtpd's Cyrus SASL at the sasldb (and, for implicit TLS, turn on
    smtpd_tls_wrappermode: the instance's start waits for a clear-text greeting), then
    reload. Debian's Postfix reads smtpd.conf from $config_directory/sasl/ (then
    /usr/lib/sasl/), whatever cyrus_sasl_config_path says (seen with strace); conf/ exists
    once the instance started."""
    if mode == "implicit":
        subprocess.run(
            ["/usr/sbin/postconf", "-c", str(pf.config_dir), "-e", "smtpd_tls_wrappermode=yes"],
            check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=30,
        )  # fmt: skip
    directory = pf.config_dir / "sasl"
    directory.mkdir(mode=0o755)
    (directory / "smtpd.conf").write_text(
        f"pwcheck_method: auxprop\nauxprop_plugin: sasldb\nsasldb_path: {db}\n"
        "mech_list: PLAIN LOGIN\n"
    )
    subprocess.run(
        ["/usr/sbin/postfix", "-c", str(pf.config_dir), "reload"],
        check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=30,
    )  # fmt: skip
    time.sleep(1)  # the smtpd processes from before the reload exit


def postfix_settings(cert: Path, key: Path) -> dict[str, str]:
    return {
        "myhostname": REALM,
        "smtpd_sasl_auth_enable": "yes",
        "smtpd_sasl_type": "cyrus",
        "smtpd_sasl_path": "smtpd",  # smtpd.conf: see install_sasl_config
        "smtpd_sasl_local_domain": REALM,
        "smtpd_sasl_security_options": "noanonymous",
        "smtpd_tls_security_level": "encrypt",
        "smtpd_tls_auth_only": "yes",
        "smtpd_tls_cert_file": str(cert),
        "smtpd_tls_key_file": str(key),
        "smtpd_tls_loglevel": "1",
        "smtpd_relay_restrictions": "permit_sasl_authenticated, reject",
        "smtpd_recipient_restrictions": "",
    }


class Mtaqueue:
    """This tree's daemon, its JSON log read in a thread. `config`: a config file (the
    shipped one, say) under the overrides. `retry`: the retry schedule to impose (None:
    the config's). `env`: more environment for the daemon (and so for its children) and
    for `ctl`."""

    def __init__(
        self,
        workdir: Path,
        *overrides: str,
        config: Path | None = None,
        retry: str | None = '["3s", "6s"]',
        env: dict[str, str] | None = None,
    ) -> None:
        self.events: list[dict] = []
        self.port = 0
        self.spool = workdir / "spool"
        # this tree, not an installed copy
        self.env = env = {**os.environ, "PYTHONPATH": str(HERE.parent), **(env or {})}
        args = [sys.executable, "-m", "mtaqueue.daemon"]
        if config is not None:
            args += ["-c", str(config)]
        for item in (
            f"spool.path={self.spool}",
            "listen.address=127.0.0.1:0",
            "listen.hostname=mtaqueue.test",
            *([f"retry.schedule={retry}"] if retry is not None else []),
            *overrides,
        ):
            args += ["-o", item]
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()
        self.wait("ready", 30)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "non_json", "text": line.strip()}
                print(f"  mtaqueue: {line.strip()}")
            if event.get("event") == "ready":
                self.port = int(event["listen"][0].rsplit(":", 1)[1])
            self.events.append(event)

    def wait(self, name: str, timeout: float, count: int = 1, **fields) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [
                e
                for e in list(self.events)
                if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())
            ]
            if len(found) >= count:
                return found
            if self.proc.poll() is not None:
                raise RuntimeError(f"mtaqueue exited: {self.events[-3:]}")
            time.sleep(0.05)
        raise TimeoutError(f"no {count} {name!r} {fields or ''} within {timeout}s")

    def send(self, n: int) -> None:
        body = f"X-Mtaqueue-Class: p0\r\nSubject: reset {n}\r\nFrom: app@sender.test\r\n\r\n"
        with smtplib.SMTP("127.0.0.1", self.port, timeout=30) as client:
            client.sendmail(
                "app@sender.test",
                [f"user{n}@example.org", f"user{n}@example.net"],  # two domains, one relay
                body.encode() + b"your code is 123456\r\n",
            )

    def ctl(self, *args: str) -> str:
        """`mtaqueue-ctl ARGS` (this tree's) on the daemon's control socket: its output."""
        return subprocess.run(
            [sys.executable, "-m", "mtaqueue.control.ctl.main",
             "-s", str(self.spool / "control.sock"), *args],
            capture_output=True, text=True, check=True, timeout=60, env=self.env,
        ).stdout  # fmt: skip

    def stop(self) -> None:
        stop_process(self.proc, 30)


def run(mode: str, workdir: Path, messages: int) -> bool:
    print(f"\n== {mode}: Postfix on {SMARTHOST}, mtaqueue's p0 through it ==")
    cert, key = make_certificate(workdir)
    db = make_sasldb(workdir / "sasl")
    port = free_port(SMARTHOST)
    password = workdir / "relay.password"
    password.write_text("wrong-password\n")
    relay = [
        f"classes.p0.relayhost=[{SMARTHOST}]:{port}",
        f"classes.p0.relay_user={USER}",
        f"classes.p0.relay_password_file={password}",
        f"classes.p0.relay_tls_ca={cert}",
        f"classes.p0.relay_tls={mode}",
    ]
    settings = postfix_settings(cert, key)
    with PostfixInstance(
        workdir / "postfix",
        listen=f"{SMARTHOST}:{port}",
        mode="receive",
        main_cf=settings,
        cleanup=False,  # its maillog stays (the work directory goes, unless --keep)
        services=TLSMGR,
    ) as pf:
        finish_setup(pf, db, mode)
        daemon = Mtaqueue(workdir, *relay)
        try:
            daemon.send(0)
            refused = daemon.wait("relay_auth_failed", 30)[0]
            deferred = daemon.wait("delivery", 30, outcome="transient")[0]
            print(f"  wrong password: relay_auth_failed {refused['reply']!r}")
            print(f"  the message: {deferred['outcome']}, next attempt in"
                  f" {deferred['next_attempt'] - time.time():.0f}s (not bounced)")  # fmt: skip
            password.write_text(PASSWORD + "\n")
            daemon.proc.send_signal(signal.SIGHUP)
            daemon.wait("relay_reconfigured", 30)
            for n in range(1, messages + 1):
                daemon.send(n)
            delivered = daemon.wait("delivery", 120, count=2 * (messages + 1), outcome="delivered")
            bounced = [e for e in daemon.events if e.get("outcome") == "permanent"]
        except (TimeoutError, RuntimeError):
            for event in daemon.events[-8:]:
                print(f"  mtaqueue: {json.dumps(event)[:300]}")
            print("  Postfix, its last lines:")
            for line in pf.maillog.read_text(errors="replace").splitlines()[-15:]:
                print(f"    {line}")
            raise
        finally:
            daemon.stop()
        time.sleep(1)  # postlogd writes asynchronously
        log = pf.maillog.read_text(errors="replace").splitlines()
        shutil.copy(pf.maillog, workdir / f"maillog-{mode}")
    destinations = {e["destination"] for e in delivered}
    print(f"  mtaqueue: {len(delivered)} recipients delivered to {sorted(destinations)}")
    return report(log, messages + 1, mode) and not bounced


def report(log: list[str], messages: int, mode: str) -> bool:
    """Print Postfix's lines for sessions, logins and acceptances; check them."""
    shown = re.compile(
        r"TLS connection established|sasl_username=|authentication failed|discard\[.*status="
        r"|disconnect from .* auth="
    )
    print("  Postfix's maillog:")
    for line in log:
        if shown.search(line):
            print("    " + re.sub(r"^\S+ \S+ ", "", line))
    tls_pids = {m[1] for line in log if (m := re.search(r"smtpd\[(\d+)\]: .*TLS connection", line))}
    logins = [
        (m[1], m[2])
        for line in log
        if (m := re.search(r"smtpd\[(\d+)\]: \w+: client=.*sasl_username=(\S+)", line))
    ]
    failed = [line for line in log if "authentication failed" in line]
    accepted = [line for line in log if re.search(r"discard\[.*status=sent", line)]
    # Cyrus names the user with its realm. A message whose recipients were deferred (the
    # wrong password) may come back as one transaction per recipient (each its own jitter).
    user = f"{USER}@{REALM}"
    in_tls = all(pid in tls_pids for pid, _ in logins)
    # smtpd's session summary: "ehlo=2 starttls=1 auth=1 mail=1 ..." with STARTTLS (587),
    # "ehlo=1 auth=1 ..." with the TLS from the first byte (465).
    sessions = [line for line in log if re.search(r"disconnect from .* auth=", line)]
    starttls = [bool(re.search(r" starttls=1 ", line)) for line in sessions]
    right_tls = bool(sessions) and all(starttls) if mode == "starttls" else not any(starttls)
    ok = (
        len(logins) >= messages
        and all(name == user for _, name in logins)
        and in_tls
        and right_tls
        and len(failed) >= 1
        and len(accepted) == 2 * messages
    )
    print(
        f"  check: {len(logins)} transactions, each with sasl_username={user}"
        f" ({all(name == user for _, name in logins)}) in a TLS session ({in_tls}),"
        f" {len(sessions)} sessions {'all with' if mode == 'starttls' else 'without'}"
        f" STARTTLS ({right_tls});"
        f" {len(failed)} failed login(s); {len(accepted)} of {2 * messages} recipients"
        " accepted: " + ("OK" if ok else "FAILED")
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=5)
    parser.add_argument("--mode", choices=("starttls", "implicit", "both"), default="both")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if not postfix_available() or not os.access(SASLPASSWD2, os.X_OK):
        print("needs root, Postfix and sasl2-bin (saslpasswd2)", file=sys.stderr)
        return 2
    modes = ("starttls", "implicit") if args.mode == "both" else (args.mode,)
    results = []
    for mode in modes:
        with work_directory(f"smarthost-{mode}-", keep=args.keep) as workdir:
            results.append(run(mode, workdir, args.messages))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
