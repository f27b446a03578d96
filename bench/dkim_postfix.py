"""DKIM round trip through a real receiving MTA: mtaqueue signs what it accepts and delivers
it to a private Postfix, which takes it in (smtpd, cleanup, its queue) and relays it to a
capturing SMTP sink; every message as the sink receives it must verify with dkimpy.

    python bench/dkim_postfix.py

Keys: example.com has an RSA-2048 and an Ed25519 key (two signatures per message). The
messages: 7-bit text; 8-bit text sent with BODY=8BITMIME; a 1,200-octet line; a 600 KB
message (streamed to disk as it arrives, past spool.stream_threshold); a From in a
subdomain (signed for example.com); folded header fields. Twice: Postfix relaying as it
is, then with `smtp_discard_ehlo_keywords = 8bitmime` (Postfix takes its next hop for a
7-bit one and would convert 8-bit mail: signed mail must need no conversion). dkimpy gets
the TXT records from the keys (the same text `mtaqueue-ctl dkim check` prints). Exit 1 if
any signature fails. Needs root and Debian's postfix package (see tests/postfix_instance.py);
loopback only.
"""

from __future__ import annotations

import smtplib
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # postfix_instance
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dkim
from accept_bench import Mtaqueue
from aiosmtpd.controller import Controller
from common import dkim_key, free_port, work_directory
from postfix_instance import PostfixInstance, postfix_available

from mtaqueue.config import load
from mtaqueue.dkim.keys import load_keys

TEXT = "Hello,\r\n\r\nyour order  has shipped.\r\n"
MESSAGES = {  # name: (From, body, MAIL options)
    "7-bit text": ("app@example.com", TEXT.encode(), ()),
    "8-bit text, BODY=8BITMIME": (
        "app@example.com",
        "Grüße aus Köln\r\n".encode(),
        ("BODY=8BITMIME",),
    ),
    "a 1,200-octet line": ("app@example.com", b"x" * 1200 + b"\r\n", ()),
    "600 KB, streamed to disk": (
        "app@example.com",
        b"".join(b"line %06d of a large message\r\n" % i for i in range(20000)),
        (),
    ),
    "From in a subdomain": ("news@mail.example.com", TEXT.encode(), ()),
}
FOLDED = "To: bob@example.org,\r\n  carol@example.org\r\nCc: dave@example.org\r\n"
HOPS = {  # Postfix's next hop: its main.cf additions
    "8BITMIME": {},
    "7-bit": {"smtp_discard_ehlo_keywords": "8bitmime"},
}


class Capture:
    """An SMTP sink that keeps what it receives, as it receives it."""

    def __init__(self, port: int) -> None:
        self.messages: list[bytes] = []
        self._lock = threading.Lock()
        self.controller = Controller(self, hostname="127.0.0.1", port=port)

    async def handle_DATA(self, server, session, envelope) -> str:
        with self._lock:
            self.messages.append(envelope.original_content)
        return "250 2.0.0 Ok: kept"


def content(name: str, sender: str, body: bytes) -> bytes:
    head = f"From: App <{sender}>\r\n{FOLDED}Subject: {name}\r\n"
    head += "MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n"
    return head.encode() + body


def verify(message: bytes, records: dict[str, str]) -> list[bool]:
    def dnsfunc(name: bytes, timeout: float = 5) -> bytes:
        return records.get(name.decode().rstrip("."), "").encode()

    verifier = dkim.DKIM(message)
    results = []
    for i in range(message.count(b"DKIM-Signature:")):
        try:
            results.append(verifier.verify(idx=i, dnsfunc=dnsfunc))
        except dkim.DKIMException:
            results.append(False)
    return results


def main() -> int:
    if not postfix_available():
        print("needs root and Debian's postfix package", file=sys.stderr)
        return 2
    failed = 0
    with work_directory("mtaqueue-dkim-") as workdir:
        signing = (
            "dkim.example.com=["
            f'{{selector = "rsa1", key_file = "{dkim_key(workdir, "rsa-sha256")}"}},'
            f'{{selector = "ed1", key_file = "{dkim_key(workdir, "ed25519-sha256")}",'
            ' algorithm = "ed25519-sha256"}]'
        )
        keys = load_keys(load(None, [signing]).dkim)["example.com"]
        records = {key.record_name: key.record() for key in keys}
        print("| Postfix's next hop | message | size at the sink | signatures (dkimpy) |")
        print("| --- | --- | --- | --- |")
        for hop, main_cf in HOPS.items():
            received = round_trip(workdir / hop, signing, main_cf)
            failed += report(hop, received, records)
    print("all signatures verify" if not failed else f"{failed} messages FAIL", flush=True)
    return 1 if failed else 0


def round_trip(workdir: Path, signing: str, main_cf: dict[str, str]) -> list[bytes]:
    """What the sink received of MESSAGES, sent through mtaqueue, then Postfix."""
    capture = Capture(free_port())
    capture.controller.start()
    listen = f"127.0.0.1:{free_port()}"
    relay = f"127.0.0.1:{capture.controller.port}"
    try:
        with PostfixInstance(
            workdir / "postfix", listen=listen, mode="relay", relay=relay, main_cf=main_cf
        ):
            relayhost = f"delivery.relayhost=[127.0.0.1]:{listen.rsplit(':', 1)[1]}"
            mq = Mtaqueue(workdir / "spool", free_port(), relayhost, signing)
            mq.start()  # its probe (no From: unsigned) goes through Postfix too
            try:
                with smtplib.SMTP("127.0.0.1", mq.port, timeout=60) as client:
                    for name, (sender, body, options) in MESSAGES.items():
                        mail = content(name, sender, body)
                        client.sendmail(sender, ["bob@example.org"], mail, options)
                deadline = time.monotonic() + 120
                while len(capture.messages) < len(MESSAGES) + 1:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{len(capture.messages)} messages arrived")
                    time.sleep(0.1)
            finally:
                mq.stop()
    finally:
        capture.controller.stop()
    return capture.messages


def report(hop: str, received: list[bytes], records: dict[str, str]) -> int:
    """Print a row per message; the number that failed."""
    failed = 0
    for message in received:
        header = message.split(b"\r\n\r\n", 1)[0]
        subject = next((f for f in header.split(b"\r\n") if f.startswith(b"Subject:")), b"")
        name = subject.partition(b":")[2].strip().decode()
        if name not in MESSAGES:
            continue  # the daemon's start-up probe
        assert b"(Postfix)" in header, "not relayed by Postfix"
        results = verify(message, records)
        failed += not results or not all(results)
        verdicts = ", ".join("pass" if ok else "FAIL" for ok in results) or "none"
        print(f"| {hop} | {name} | {len(message):,} | {verdicts} |", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
