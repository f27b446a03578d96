"""Time from a restart to the first delivery attempt, with a large backlog due at once.

    python bench/restart_latency.py [--messages 12000] [--domains 50]

Fills a spool with MESSAGES queued messages to DOMAINS domains that share one MX host
(a test DNS server and a test SMTP peer on loopback), starts the daemon with delivery
enabled and prints when it logged `ready` and its first `delivery` event.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from accept_bench import fill_spool  # noqa: E402
from common import byte_compiled  # noqa: E402
from dns_server import DnsServer  # noqa: E402
from smtp_peer import peers_on_one_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=12000)
    parser.add_argument("--domains", type=int, default=50)
    args = parser.parse_args()
    byte_compiled()
    spool = Path(tempfile.mkdtemp(prefix="mtaqueue-restart-")) / "spool"
    fill_spool(spool, args.messages, 2048, domains=args.domains)
    with DnsServer() as dns:
        for i in range(args.domains):
            dns.add(f"example{i}.org", "MX", "10 mx1.provider.test")
        dns.add("mx1.provider.test", "A", "127.0.0.2")
        (peer,) = peers_on_one_port(["127.0.0.2"], keep_content=False)
        started = time.monotonic()
        daemon = subprocess.Popen(
            [sys.executable, "-m", "mtaqueue.daemon",
             "-o", f"spool.path={spool}", "-o", "listen.address=127.0.0.1:0",
             "-o", f'dns.nameservers=["{dns.address}"]', "-o", f"delivery.port={peer.port}",
             "-o", "retry.restart_spread=0.6s"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert daemon.stderr is not None
            for line in daemon.stderr:
                event = json.loads(line)["event"]
                if event in ("ready", "delivery"):
                    print(f"{time.monotonic() - started:6.2f} s  {event}", flush=True)
                if event == "delivery":
                    break
        finally:
            daemon.terminate()
            daemon.wait()
            peer.stop()


if __name__ == "__main__":
    main()
