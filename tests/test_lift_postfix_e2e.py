"""A flush after an outage, against a real Postfix provider that is still down, then back
(issue 22, point 1): one probe connection for the whole command, however many chunks the
flush walks, and delivery behind the probe once Postfix answers.

"Down for maintenance" is Postfix's own: its access map answers our address with a 421
at connect (`smtpd_delay_reject = no`, so the client restriction is the greeting) and
smtpd disconnects; every connection is a "connect from" line in its maillog, which is what
is counted. Back is the map emptied and a `postfix reload`. The daemon runs the shipped
config (conf/mtaqueue.toml: a host suspended for 1 minute, doubled on each further
failure), told only where the test DNS and Postfix are. Needs root and Debian's postfix
package (the `postfix_installed` fixture fails the test when either is missing).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from dns_server import DnsServer
from e2e_helpers import BODY, ctl_json, events, wait_for
from postfix_instance import PostfixInstance, received
from postfix_tools import unused_port

SHIPPED = Path(__file__).resolve().parent.parent / "conf" / "mtaqueue.toml"
MAINTENANCE = "421 4.3.2 Service shutting down for maintenance"
BULK = 4500  # three chunks of the flush's walk (2,000 messages each)


@pytest.fixture
def provider(postfix_installed):
    """Postfix receiving example.org (accepted mail is logged and dropped) on 127.0.0.1,
    down for maintenance; the test DNS pointing example.org's MX at it."""
    workdir = Path(tempfile.mkdtemp(prefix="pfx-lift-", dir="/tmp"))  # the postfix user enters
    workdir.chmod(0o755)
    postfix = PostfixInstance(
        workdir / "pf",
        listen=f"127.0.0.1:{unused_port()}",
        mode="receive",
        domains=("example.org",),
        main_cf={"myhostname": "mx.provider.test", "smtpd_delay_reject": "no"},
    )
    dns = DnsServer().start()
    try:
        dns.add("example.org", "MX", "10 mx.provider.test")
        dns.add("mx.provider.test", "A", "127.0.0.1")
        postfix.start()  # up first: start() waits for its 220
        postfix.client_access = {"127.0.0.1/32": MAINTENANCE}
        postfix.reload()
        yield dns, postfix
    finally:
        postfix.stop()
        dns.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def connections(postfix: PostfixInstance) -> int:
    return received(postfix.maillog)["clients"].get("127.0.0.1", {}).get("connections", 0)


def test_a_flush_of_many_chunks_probes_a_still_down_postfix_once(provider, start_daemon):
    dns, postfix = provider
    daemon = start_daemon(
        f'dns.nameservers=["{dns.address}"]',
        f"delivery.port={postfix.port}",
        "delivery.enabled=true",
        config=SHIPPED.read_text(),
    )
    daemon.send("app@sender.test", ["a@example.org"], BODY)
    [host] = wait_for(lambda: ctl_json(daemon, "hosts"), what="the host suspended")
    assert host["reply"].startswith("421 4.3.2 ") and "maintenance" in host["reply"]
    with daemon.smtp() as client:  # mail that waits on the suspension: no connection for it
        for i in range(BULK):
            assert client.sendmail("app@sender.test", [f"b{i}@example.org"], BODY) == {}
    time.sleep(1)
    before = connections(postfix)
    assert before >= 1

    assert ctl_json(daemon, "flush", "--all") == [{"flushed": BULK + 1}]
    time.sleep(3)
    assert connections(postfix) == before + 1  # one probe for the command, not one a chunk
    [host] = ctl_json(daemon, "hosts")
    assert host["failures"] == 2 and host["until"] > time.time() + 90  # again, for 2 minutes
    assert len([e for e in events(daemon, "destination_lifted") if e.get("by") == "flush"]) == 1
    assert len(daemon.messages()) == BULK + 1  # nothing lost, nothing bounced

    # Back: the next flush's probe is accepted and everything follows it.
    postfix.client_access = {}
    postfix.reload()
    flushed = time.time()
    assert ctl_json(daemon, "flush", "--all") == [{"flushed": BULK + 1}]
    wait_for(lambda: received(postfix.maillog)["accepted"], timeout=10, what="a delivery")
    assert time.time() - flushed < 10  # not after the 2-minute suspension
    # Paced from there on (a slow start, as for any destination after a lift).
    wait_for(lambda: len(received(postfix.maillog)["accepted"]) >= 100, timeout=60, what="100")
    assert ctl_json(daemon, "hosts") == []
