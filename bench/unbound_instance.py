"""A private, throwaway Unbound serving test zones on loopback, for the benchmarks that
must show mtaqueue against a DNS server we did not write.

Everything lives in one work directory (``unbound.conf``, its log). Unbound runs in the
foreground (``-d``) as a child of the bench; the zones are ``local-zone ... static`` with
their ``local-data``, and every other name is refused (``local-zone: "." refuse``), so the
resolver never asks anything outside the machine.

    zones = {"example.test": [
        "example.test. 300 IN MX 10 mx.example.test.",
        "mx.example.test. 300 IN A 127.0.0.20",
        "mx.example.test. 300 IN AAAA ::1",
        txt("_mta-sts.example.test.", "v=STSv1; id=1"),
    ]}
    with UnboundInstance(workdir, zones) as dns:
        config["dns"] = {"nameservers": [dns.address]}   # "127.0.0.1:PORT"

Needs Debian's ``unbound`` package (``apt-get install unbound``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import dns.rcode

TXT_CHUNK = 255  # octets per character-string (RFC 1035 3.3); DKIM RSA keys need several


def unbound_available() -> bool:
    return shutil.which("unbound") is not None or Path("/usr/sbin/unbound").exists()


def txt(name: str, text: str, ttl: int = 300) -> str:
    """A TXT record of any length, as character-strings of at most 255 octets."""
    chunks = [text[i : i + TXT_CHUNK] for i in range(0, len(text), TXT_CHUNK)] or [""]
    return f"{name} {ttl} IN TXT " + " ".join(f'"{c}"' for c in chunks)


def _free_udp_tcp_port(host: str) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
            return port


class UnboundInstance:
    def __init__(
        self,
        workdir: Path,
        zones: dict[str, list[str]],
        host: str = "127.0.0.1",
        port: int = 0,
        kinds: dict[str, str] | None = None,
    ) -> None:
        """`port` 0: a free one, picked at the first start and kept by restart(). `kinds`:
        a zone's local-zone type other than "static", e.g. {"accept.test": "redirect"}
        (every name under it answered from the zone's own records: a wildcard domain)."""
        self.dir = Path(workdir) / "unbound"
        self.zones = zones
        self.kinds = kinds or {}
        self.host = host
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """As `dns.nameservers` takes it."""
        return f"{self.host}:{self.port}"

    def config(self) -> str:
        lines = [
            "server:",
            f"  interface: {self.host}@{self.port}",
            f"  port: {self.port}",
            "  do-daemonize: no",
            '  username: ""',
            '  chroot: ""',
            f'  directory: "{self.dir}"',
            '  pidfile: ""',
            f'  logfile: "{self.dir / "unbound.log"}"',
            "  use-syslog: no",
            "  verbosity: 1",
            "  log-queries: yes",
            "  access-control: 127.0.0.0/8 allow",
            "  do-ip6: no",
            '  module-config: "iterator"',  # no DNSSEC validation: no trust anchor to fetch
            "  num-threads: 1",
            '  local-zone: "." refuse',  # nothing is ever asked outside the machine
        ]
        for zone, records in self.zones.items():
            kind = self.kinds.get(zone, "static")
            lines.append(f'  local-zone: "{zone.rstrip(".")}." {kind}')
            lines += [f"  local-data: '{record}'" for record in records]
        return "\n".join(lines) + "\n"

    def __enter__(self) -> UnboundInstance:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 10.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or _free_udp_tcp_port(self.host)
        conf = self.dir / "unbound.conf"
        conf.write_text(self.config())
        checked = subprocess.run(
            ["unbound-checkconf", str(conf)], capture_output=True, text=True, check=False
        )
        if checked.returncode:
            raise RuntimeError(f"unbound-checkconf: {checked.stdout}{checked.stderr}")
        self.process = subprocess.Popen(
            ["unbound", "-d", "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        zone = next(iter(self.zones), "localhost")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"unbound exited: {self.process.stderr.read().decode()}")
            try:
                answer = dns.query.udp(
                    dns.message.make_query(zone, "SOA"), self.host, port=self.port, timeout=0.5
                )
            except (OSError, dns.exception.Timeout):
                time.sleep(0.1)
                continue
            if answer.rcode() == dns.rcode.NOERROR:
                return
        self.stop()
        raise RuntimeError(f"unbound did not answer on {self.address} in {timeout} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self, zones: dict[str, list[str]] | None = None) -> None:
        """Stop, then start with `zones` (default: the same) on the same address, so that
        a client's dns.nameservers still point at it. The log goes on (appended)."""
        self.stop()
        if zones is not None:
            self.zones = zones
        self.start()

    def log(self) -> str:
        path = self.dir / "unbound.log"
        return path.read_text(errors="replace") if path.exists() else ""


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        demo = {
            "example.test": [
                "example.test. 300 IN MX 10 mx.example.test.",
                "mx.example.test. 300 IN A 127.0.0.20",
                "mx.example.test. 300 IN AAAA ::1",
                txt("long.example.test.", "x" * 600),
            ]
        }
        with UnboundInstance(Path(tmp), demo) as server:
            asked = [("example.test", "MX"), ("mx.example.test", "AAAA")]
            for name, kind in [*asked, ("long.example.test", "TXT"), ("gmail.com", "MX")]:
                q = dns.message.make_query(name, kind, use_edns=0, payload=4096)
                r = dns.query.udp(q, server.host, port=server.port, timeout=2)
                answers = [a.to_text()[:70] for a in r.answer]
                print(name, kind, dns.rcode.to_text(r.rcode()), answers)
        sys.exit(0)
