"""Hung destinations against one that answers, with the shipped config (issue 22, point 4).

    python bench/hung_destinations.py [--hung 500] [--per-destination 2] [--healthy 6]
                                      [--interval 2] [--keep]

The daemon runs with conf/mtaqueue.toml as shipped (100 global connections, a 5-minute
banner timeout); only what a test machine needs is overridden: the spool and control
socket in a work directory, the listener on 127.0.0.1:0, the test DNS server on loopback
and the delivery port (every MX listens on one port, on its own 127.x address), and
delivery enabled (the harness starts it off).

`--hung` destinations publish an MX whose address accepts TCP and never writes a byte
(tests/hung_listeners.py); each gets `--per-destination` messages, submitted first. Then
`--healthy` messages go to one real SMTP peer (tests/smtp_peer.py): one a second into
the hung mail's submission (while their connects are being opened), one right after it,
the rest `--interval` seconds apart. Printed: each healthy message's latency (submission
to the peer's final dot) with the sockets open to hung listeners at that moment, and at
the end how many hung listeners were reached, the most connections any one of them had
at once, and their accepts in all. Exit status 1 if a healthy message took more than 2 s.

Each hung destination holds a socket until its banner timeout: with 500 of them the
bench and the daemon need ~1,100 file descriptors and more; the soft RLIMIT_NOFILE is
raised to the hard limit for this process and the daemon it starts.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "tests"))  # the test DNS, SMTP peer, hung listeners, daemon

from common import work_directory  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402
from dns_server import DnsServer  # noqa: E402
from hung_listeners import HungListeners, hung_addresses  # noqa: E402
from smtp_peer import SmtpPeer  # noqa: E402

BODY = b"Subject: hello\r\nFrom: app@sender.test\r\n\r\nhello world\r\n"
BOUND = 2.0  # seconds: the healthy mail's bound


def raise_nofile() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def submit(daemon: DaemonProcess, recipients: list[str]) -> None:
    """One message per recipient, over one SMTP session."""
    with daemon.smtp() as client:
        for rcpt in recipients:
            client.sendmail("app@sender.test", [rcpt], BODY)


def latency(daemon: DaemonProcess, peer: SmtpPeer, rcpt: str) -> float:
    submitted = time.time()
    daemon.send("app@sender.test", [rcpt], BODY)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        got = [m for m in list(peer.messages) if rcpt in m.rcpt_tos]
        if got:
            return got[0].time - submitted
        time.sleep(0.005)
    return float("inf")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hung", type=int, default=500)
    parser.add_argument("--per-destination", type=int, default=2)
    parser.add_argument("--healthy", type=int, default=6)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    soft, hard = raise_nofile()
    print(
        f"RLIMIT_NOFILE {soft}/{hard}; {args.hung} hung destinations x "
        f"{args.per_destination} messages; shipped config (conf/mtaqueue.toml)"
    )
    config = (REPO / "conf" / "mtaqueue.toml").read_text()
    addresses = hung_addresses(args.hung)
    with work_directory("hung-", keep=args.keep) as workdir:
        dns = DnsServer().start()
        peer = SmtpPeer("127.0.0.2", 0, keep_content=False).start()
        hung = HungListeners(addresses, peer.port).start()
        daemon = None
        failed = False
        try:
            dns.add("healthy.test", "MX", "10 mx.healthy.test")
            dns.add("mx.healthy.test", "A", "127.0.0.2")
            for i, address in enumerate(addresses):
                dns.add(f"hung{i}.test", "MX", f"10 mx.hung{i}.test")
                dns.add(f"mx.hung{i}.test", "A", address)
            daemon = DaemonProcess(
                workdir,
                "delivery.enabled=true",
                f'dns.nameservers=["{dns.address}"]',
                f"delivery.port={peer.port}",
                config=config,
            ).start()
            started = time.monotonic()
            recipients = [
                f"u{j}@hung{i}.test" for j in range(args.per_destination) for i in range(args.hung)
            ]
            batch = threading.Thread(target=submit, args=(daemon, recipients))
            batch.start()
            time.sleep(1.0)
            print(" #   at (s)  latency (s)  sockets open to hung listeners")
            during = latency(daemon, peer, "during@healthy.test")
            failed |= during > BOUND
            print(f" d {1.0:7.2f}  {during:11.3f}  {hung.open_now():5d}  (during the submission)")
            batch.join()
            took = time.monotonic() - started
            print(f"submitted {len(recipients)} hung messages in {took:.2f} s")
            for n in range(args.healthy):
                if n:
                    time.sleep(args.interval)
                at = time.monotonic() - started
                seconds = latency(daemon, peer, f"h{n}@healthy.test")
                failed |= seconds > BOUND
                print(f"{n:2d} {at:7.2f}  {seconds:11.3f}  {hung.open_now():5d}")
            most = max(hung.most_open[a] for a in addresses)
            reached = sum(1 for a in addresses if hung.accepts[a])
            print(
                f"hung listeners reached: {reached} of {args.hung}; most open at once on "
                f"one: {most}; accepts in all: {sum(hung.accepts.values())}"
            )
        finally:
            if daemon is not None:
                daemon.kill()
            hung.stop()
            peer.stop()
            dns.stop()
    print("FAIL: a healthy message took more than 2 s" if failed else "ok: all within 2 s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
