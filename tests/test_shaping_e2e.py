"""Traffic shaping and operations end to end: daemon, test DNS, scriptable peers."""

from __future__ import annotations

import time

import pytest
from e2e_helpers import BODY, FAST, MailNet, ctl_json, events, wait_for
from smtp_peer import Late, Received

# One connection, any class may use it: the order of delivery is the queue's order.
ONE_CONNECTION = (
    "shaping.default.max_connections=1",
    "shaping.default.initial_connections=1",
    "shaping.default.reserved_p0=0",
)


class Provider(MailNet):
    """One provider (two domains on the same MX host) plus the senders' home MX."""

    def __init__(self, start_daemon) -> None:
        super().__init__(["127.0.0.2", "127.0.0.9"])
        self.mx, self.home = self.peers
        for domain in ("example.org", "example.net"):
            self.add_domain(domain, "127.0.0.2", host="mx.provider.test")
        self.add_domain("sender.test", "127.0.0.9")
        self._start = start_daemon

    def daemon(self, *overrides: str):
        return self._start(*self.daemon_overrides(), *FAST, *overrides)

    def backlog(self, *overrides: str):
        """A daemon that only queues (delivery.enabled=false), for `drain`."""
        return self.daemon("delivery.enabled=false", *overrides)

    def drain(self, daemon) -> list[Received]:
        """Restart a daemon that was only queueing (delivery.enabled=false) delivering; when
        its queue is empty, what the provider got, in order."""
        restart_with_delivery(daemon)
        wait_for(lambda: not daemon.messages(), timeout=30, what="the backlog to drain")
        return list(self.mx.messages)


@pytest.fixture
def provider(start_daemon):
    with Provider(start_daemon) as p:
        yield p


def send_class(daemon, klass: str, rcpt: str) -> str:
    return daemon.send("app@sender.test", [rcpt], f"X-Mtaqueue-Class: {klass}\r\n".encode() + BODY)


def send_many(daemon, klass: str, prefix: str, count: int) -> list[str]:
    """`count` messages of `klass` to PREFIX0@example.org, PREFIX1@..., in that order."""
    return [send_class(daemon, klass, f"{prefix}{i}@example.org") for i in range(count)]


def last_place(order: list[str], prefix: str, count: int) -> int:
    """Where the last of PREFIX0@example.org ... came in `order` (recipients)."""
    return max(order.index(f"{prefix}{i}@example.org") for i in range(count))


def restart_with_delivery(daemon) -> None:
    """Stop a daemon that was queueing only and start it again delivering everything."""
    assert daemon.stop() == 0
    daemon.overrides.append("delivery.enabled=true")
    daemon.start()


def send_as(daemon, tenant: str, rcpt: str) -> str:
    return daemon.send("app@sender.test", [rcpt], f"X-Tenant: {tenant}\r\n".encode() + BODY)


def test_hold_and_release_by_domain_and_class(provider):
    provider.mx.on("rcpt", "451 4.3.0 try later")
    daemon = provider.daemon('retry.schedule=["60s"]')
    bulk = send_many(daemon, "p2", "b", 3)
    reset = send_class(daemon, "p0", "r@example.net")
    wait_for(lambda: len(events(daemon, "delivery")) == 4, what="first attempts")

    assert ctl_json(daemon, "hold", "--class", "p2") == [{"held": 3}]
    queue = daemon.messages()
    assert all(queue[i]["held"] and queue[i]["recipients"][0]["state"] == "held" for i in bulk)
    assert not queue[reset]["held"]
    assert daemon.ctl("hold").returncode != 0  # no selection: refused, nothing held

    provider.mx.on("rcpt", None)  # the receiver is fine again
    assert ctl_json(daemon, "flush", "--all") == [{"flushed": 1}]  # held mail is not flushed
    wait_for(lambda: reset not in daemon.messages(), what="the p0 message")
    time.sleep(1)
    assert set(bulk) <= set(daemon.messages())  # still held
    assert ctl_json(daemon, "release", "--domain", "example.org") == [{"released": 3}]
    assert ctl_json(daemon, "flush", "--domain", "example.org") == [{"flushed": 3}]
    wait_for(lambda: not daemon.messages(), what="the released messages")


def test_flush_keeps_the_greylisting_minimum(provider):
    provider.mx.greylist(60)
    daemon = provider.daemon("retry.greylist_min=4s", 'retry.schedule=["60s"]')
    queue_id = daemon.send("app@sender.test", ["g@example.org"], BODY)
    wait_for(lambda: events(daemon, "delivery"), what="the greylisted attempt")
    first = time.time()
    provider.mx.greylist(0)
    assert ctl_json(daemon, "flush", queue_id) == [{"flushed": 1}]
    due = daemon.messages()[queue_id]["recipients"][0]["next_attempt"]
    assert due >= first + 3.0  # not now: the greylist window still applies
    wait_for(lambda: not daemon.messages(), timeout=15, what="delivery after the window")
    tries = [e for e in provider.mx.log if e.phase == "rcpt"]
    assert tries[-1].time - tries[0].time >= 3.5


def test_p0_goes_first_while_bulk_waits(provider):
    daemon = provider.daemon(
        *ONE_CONNECTION, "shaping.default.messages_per_minute=120", "shaping.default.burst=1"
    )
    send_many(daemon, "p2", "bulk", 12)
    send_class(daemon, "p0", "reset@example.org")
    wait_for(lambda: not daemon.messages(), timeout=30, what="the whole queue")
    order = [m.rcpt_tos[0] for m in provider.mx.messages]
    assert order.index("reset@example.org") <= 3  # not behind the bulk backlog


def test_domains_view_and_runtime_limit(provider):
    provider.mx.on("rcpt", "451 4.3.0 try later")
    daemon = provider.daemon('retry.schedule=["60s"]')
    send_class(daemon, "p1", "a@example.org")
    send_class(daemon, "p1", "b@example.net")
    wait_for(lambda: len(events(daemon, "delivery")) == 2)
    (dest,) = ctl_json(daemon, "domains")
    # One provider, one destination (named by its MX hosts; the port as it is not 25).
    assert dest["destination"] == f"mx.provider.test:{provider.mx.port}"
    assert dest["domains"] == ["example.net", "example.org"]
    assert dest["deferral_rate"] == 1.0 and "451 4.3.0 try later" in dest["last_replies"][-1]
    assert dest["mode"] == "normal" and dest["circuit"] == "closed"
    result = ctl_json(daemon, "limit", "--domain", "example.org", "--rate", "6/min", "--for", "1h")
    assert result[0]["destinations"] == 1
    (dest,) = ctl_json(daemon, "domains")
    assert dest["override"]
    name = dest["destination"]
    assert ctl_json(daemon, "backoff", "--domain", name, "--for", "10m")[0]["destinations"] == 1
    (dest,) = ctl_json(daemon, "domains")
    assert dest["mode"] == "backoff"
    # `--for 0` ends it at once (docs/runbooks.md, flushing one domain).
    ctl_json(daemon, "backoff", "--domain", name, "--for", "0")
    (dest,) = ctl_json(daemon, "domains")
    assert dest["mode"] == "normal"


def test_domains_lists_mail_deferred_on_a_suspended_host(provider):
    provider.mx.refuse_connections()
    daemon = provider.daemon("delivery.host_suspend=1h", 'retry.schedule=["1h"]')
    send_class(daemon, "p2", "a@example.org")
    wait_for(lambda: events(daemon, "delivery"), what="the refused attempt")
    wait_for(lambda: events(daemon, "host_suspended"), what="the host's suspension")
    (dest,) = ctl_json(daemon, "domains")
    assert dest["destination"] == f"mx.provider.test:{provider.mx.port}"
    assert dest["deferred"] == {"p2": 1} and dest["active"] == 0
    [host] = dest["suspended_hosts"]
    assert host in ("mx.provider.test", f"mx.provider.test:{provider.mx.port}")  # port or not
    text = daemon.ctl("domains").stdout
    assert "  deferred    p2 1" in text and f"  suspended   {host} until" in text
    # No rate configured: the learned one paces, from the slow start.
    assert "  rates       120/min messages, unlimited connections" in text
    assert "  learned     rate 120/min (slow-start, probing)" in text
    assert "    taught by nothing yet (slow start)" in text
    # After a restart nothing has routed it yet: it is listed by its domain.
    daemon.restart()
    (dest,) = ctl_json(daemon, "domains")
    assert (dest["destination"], dest["routed"], dest["deferred"]) == (
        "example.org",
        False,
        {"p2": 1},
    )
    assert dest["last_replies"] == ["127.0.0.2 refused"]  # the recipient's own last reply


def test_breaker_opens_then_probes_and_recovers(provider):
    provider.mx.refuse_connections()
    daemon = provider.daemon(
        "shaping.breaker_failures=2",
        "shaping.breaker_cooldown=3s",
        "shaping.release_spread=2s",
        "delivery.host_suspend=1s",
        'retry.schedule=["1s"]',
        'retry.then=["1s", "1s"]',
    )
    send_many(daemon, "p1", "c", 4)
    wait_for(
        lambda: any(d["circuit"] == "open" for d in ctl_json(daemon, "domains")),
        what="the breaker to open",
    )
    tried = len(events(daemon, "delivery"))
    provider.mx.resume()
    time.sleep(1.0)
    assert len(events(daemon, "delivery")) <= tried + 1  # open: no attempts beyond a probe
    wait_for(lambda: not daemon.messages(), timeout=30, what="recovery after the probe")
    # Kept while its stats window has replies to show, though no mail waits for it now.
    (dest,) = ctl_json(daemon, "domains")
    assert dest["circuit"] == "closed" and dest["deferred"] == {}
    # The probe delivered one; the three that waited were let go over release_spread (one
    # in each third of it), not as a herd the moment the circuit closed.
    changes = [(e["circuit"], e["released"]) for e in events(daemon, "destination_changed")]
    assert changes == [("open", 0), ("closed", 3)]
    times = sorted(m.time for m in provider.mx.messages)
    assert len(times) == 4 and times[-1] - times[0] >= 2 * 2 / 3 - 0.1


def test_throttling_cuts_the_learned_rate_without_backoff_mode(provider):
    provider.mx.on(
        "mail",
        "421 4.7.28 Our system has detected an unusual rate of mail; temporarily rate limited",
        times=2,
    )
    daemon = provider.daemon('retry.schedule=["1s"]')
    send_many(daemon, "p1", "t", 3)
    wait_for(lambda: events(daemon, "requeued"), what="a throttling reply")
    (learned,) = wait_for(
        lambda: [e for e in events(daemon, "limit_learned") if e["new"] < e["old"]],
        what="the learned rate cut",
    )
    assert learned["what"] == "rate" and learned["reply"].startswith("421 4.7.28")
    assert learned["new"] < 120  # under the slow start it was sent at
    (dest,) = ctl_json(daemon, "domains")
    assert dest["mode"] == "normal"  # retries are not stretched
    assert dest["learned"]["rate_reply"].startswith("421 4.7.28")
    assert dest["messages_per_minute"] == pytest.approx(dest["learned"]["rate_per_minute"])
    wait_for(lambda: not daemon.messages(), timeout=30, what="delivery after the throttling")


def test_throttle_refused_mail_goes_again_after_the_cool_down_uncharged(provider):
    rate = "421 4.7.28 Our system has detected an unusual rate of mail; temporarily rate limited"
    provider.mx.on("mail", rate, times=1)
    daemon = provider.daemon('retry.schedule=["60s"]')  # a charged retry would come too late
    queue_id = send_class(daemon, "p1", "t@example.org")
    (requeued,) = wait_for(lambda: events(daemon, "requeued"), what="the throttle refusal")
    assert requeued["id"] == queue_id and requeued["reason"].startswith("421 4.7.28")
    assert requeued["refusals"] == 1
    # Back in the ready queue, not charged: no attempt, no retry step.
    rcpt = daemon.messages()[queue_id]["recipients"][0]
    assert rcpt["attempts"] == 0 and rcpt["next_attempt"] is None
    (delivered,) = wait_for(lambda: events(daemon, "delivery"), timeout=20, what="delivery")
    assert delivered["outcome"] == "delivered" and delivered["attempt"] == 1
    mails = [e.time for e in provider.mx.log if e.phase == "mail"]
    assert len(mails) == 2 and mails[1] - mails[0] >= 4.5  # after the 5 s cool-down


def test_restart_with_an_overdue_backlog_sends_p0_first(provider):
    daemon = provider.backlog(*ONE_CONNECTION, "retry.restart_spread=3s")
    send_many(daemon, "p2", "bulk", 10)
    send_class(daemon, "p0", "reset@example.org")
    received = provider.drain(daemon)
    assert received[0].rcpt_tos == ["reset@example.org"]
    times = [m.time for m in received]
    assert times[-1] - times[1] > 1.0  # the bulk was spread out, not a herd


def test_the_first_class_is_one_class_everywhere(provider):
    """Two classes at the lowest priority: the one the queue serves first is the one the
    restart does not spread (the same rule everywhere: the name that sorts first)."""
    daemon = provider.backlog("classes.a.priority=0", *ONE_CONNECTION, "retry.restart_spread=0s")
    send_many(daemon, "p0", "p0-", 5)
    send_class(daemon, "a", "first@example.org")
    received = provider.drain(daemon)
    assert received[0].rcpt_tos == ["first@example.org"]


def test_a_lowered_limit_closes_connections_and_bulk_keeps_moving(provider):
    """A p0 wave while concurrency grows opens reserved (first-class) connections; once
    the p0 mail is gone and an operator lowers the limit, the connections over it close
    and the bulk goes on over the ones left."""
    daemon = provider.backlog(
        "shaping.default.max_connections=4",
        "shaping.default.initial_connections=1",
        "shaping.default.reserved_p0=1",
        "shaping.default.messages_per_minute=900",
        "shaping.default.burst=1",
        "retry.restart_spread=0s",
        "delivery.connection_idle=30s",  # idle connections would linger
    )
    send_many(daemon, "p0", "reset", 30)
    send_many(daemon, "p2", "bulk", 150)
    mx = provider.mx
    # A slow site (0.2 s a message): one connection does not keep up with the rate, so
    # connections open while the wave waits (an idle one takes the work first).
    mx.on("data_end", Late(0.2, "250 2.0.0 ok"))
    restart_with_delivery(daemon)
    mx.wait_for(lambda: len(mx.messages) >= 45, timeout=30)  # the p0 wave and some bulk
    # p0 first (a bulk message or two may overtake the last p0 ones in flight elsewhere).
    order = [m.rcpt_tos[0] for m in mx.messages]
    assert last_place(order, "reset", 30) < 33
    assert mx.max_active == 4  # the limit grew to 4 during the wave
    assert ctl_json(daemon, "limit", "--domain", "example.org", "--concurrency", "2")
    mx.wait_for(lambda: mx.active <= 2, timeout=5)  # the two over the limit closed
    (dest,) = ctl_json(daemon, "domains")
    assert dest["active"] <= 2 and dest["queued"]["p2"] > 0
    delivered = len(mx.messages)
    mx.wait_for(lambda: len(mx.messages) >= delivered + 20, timeout=5)  # bulk goes on
    assert mx.active <= 2
    wait_for(lambda: not daemon.messages(), timeout=30, what="the backlog to drain")


def test_the_connection_rate_holds_for_every_connection(start_daemon):
    """connections_per_minute counts every connection a slot opens: the first, one after
    messages_per_connection, and one to the next MX host when the first fails."""
    with MailNet(["127.0.0.2", "127.0.0.3", "127.0.0.9"]) as net:
        mx1, mx2, _ = net.peers
        net.add_domain("example.org", "127.0.0.2", "127.0.0.3")
        net.add_domain("sender.test", "127.0.0.9")
        mx1.banner = "421 4.3.2 service not available"
        daemon = start_daemon(
            *net.daemon_overrides(),
            *FAST,
            "shaping.default.connections_per_minute=3",
            "shaping.default.burst=3",
            "shaping.default.messages_per_connection=1",
            *ONE_CONNECTION,
        )
        send_many(daemon, "p1", "r", 5)
        mx2.wait_messages(2)
        time.sleep(6)  # the fourth token is 20 s away
        # mx1 refused one, mx2 took two: the burst of 3; old code: 6 connections at once.
        assert (mx1.connections, mx2.connections) == (1, 2)
        assert len(mx2.messages) == 2


def test_tenants_take_turns_within_a_class(provider):
    daemon = provider.backlog(
        "submission.tenant_header=X-Tenant", *ONE_CONNECTION, "retry.restart_spread=0s"
    )
    for i in range(12):
        send_as(daemon, "big", f"big{i}@example.org")
    for i in range(3):
        send_as(daemon, "small", f"small{i}@example.org")
    received = provider.drain(daemon)
    order = [m.rcpt_tos[0] for m in received]
    # Round-robin: the small tenant's three go out among the first six, not after twelve.
    assert last_place(order, "small", 3) < 6
    assert all(b"X-Tenant" not in m.content for m in received)  # removed


def test_hold_and_release_by_tenant(provider):
    daemon = provider.backlog("submission.tenant_header=X-Tenant")
    noisy = [send_as(daemon, "noisy", f"n{i}@example.org") for i in range(2)]
    quiet = send_as(daemon, "quiet", "q@example.org")
    assert ctl_json(daemon, "hold", "--tenant", "noisy") == [{"held": 2}]
    queue = daemon.messages()
    assert [queue[i]["held"] for i in (*noisy, quiet)] == [True, True, False]
    assert ctl_json(daemon, "release", "--tenant", "quiet") == [{"released": 0}]
    assert ctl_json(daemon, "release", "--tenant", "noisy") == [{"released": 2}]
    assert not any(m["held"] for m in daemon.messages().values())


def test_tenant_rate_caps_one_tenant_not_the_others(provider):
    daemon = provider.backlog(
        "submission.tenant_header=X-Tenant",
        'shaping.tenant_rate="150/min"',  # one every 0.4 s per tenant
        "retry.restart_spread=0s",
    )
    for i in range(6):
        send_as(daemon, "capped", f"c{i}@example.org")
    daemon.send("app@sender.test", ["free@example.org"], BODY)  # no tenant: no cap
    times = {m.rcpt_tos[0]: m.time for m in provider.drain(daemon)}
    capped = sorted(times[f"c{i}@example.org"] for i in range(6))
    assert capped[-1] - capped[0] >= 5 * 0.4 - 0.1  # never faster than the cap
    assert times["free@example.org"] < capped[2]  # not queued behind the capped tenant


def test_global_rate_cap_over_all_destinations(provider):
    daemon = provider.daemon('delivery.max_rate="300/min"')  # one every 0.2 s in all
    for i in range(4):
        send_class(daemon, "p1", f"a{i}@example.org")
        send_class(daemon, "p1", f"b{i}@example.net")
    wait_for(lambda: not daemon.messages(), timeout=30, what="the queue to drain")
    times = sorted(m.time for m in provider.mx.messages)
    assert len(times) == 8
    assert times[-1] - times[0] >= 7 * 0.2 - 0.1  # never faster than the cap


def test_delete_bounce_requeue_and_selection_filters(provider):
    provider.mx.on("rcpt", "451 4.3.0 try later")
    daemon = provider.daemon('retry.schedule=["60s"]')
    gone = send_class(daemon, "p2", "d@example.org")
    returned = send_class(daemon, "p1", "b@example.net")
    kept = send_class(daemon, "p1", "k@example.net")
    wait_for(lambda: len(events(daemon, "delivery")) == 3)
    assert ctl_json(daemon, "delete", "--older-than", "1h", "--all") == [{"deleted": 0}]
    assert ctl_json(daemon, "delete", gone) == [{"deleted": 1}]
    assert ctl_json(daemon, "bounce", returned) == [{"bounced": 1}]
    (dsn,) = wait_for(lambda: provider.home.messages, what="the operator's bounce DSN")
    assert b"451 4.3.0 try later" in dsn.content  # the last real reply
    assert set(daemon.messages()) == {kept}
    provider.mx.on("rcpt", None)
    assert ctl_json(daemon, "requeue", "--state", "deferred") == [{"requeued": 1}]
    wait_for(lambda: not daemon.messages(), what="the requeued message")


def test_a_release_of_more_than_a_chunk_waits_in_line_and_all_goes_p0_first(provider):
    """`release --all` of more mail than one step of the active window takes (2,000):
    the rest waits in line and goes as the window has room, the first class ahead of
    it; every message is delivered once."""
    count = 2_100
    daemon = provider.backlog()
    with daemon.smtp() as client:  # one session: thousands of submissions in seconds
        for i in range(count):
            client.sendmail("app@sender.test", [f"b{i}@example.org"], BODY)
    urgent = send_class(daemon, "p0", "r@example.net")
    assert ctl_json(daemon, "hold", "--all") == [{"held": count + 1}]
    restart_with_delivery(daemon)
    time.sleep(1)
    assert provider.mx.messages == []  # held: nothing goes
    assert ctl_json(daemon, "release", "--all") == [{"released": count + 1}]
    wait_for(lambda: not daemon.messages(), timeout=90, what="the released messages")
    rcpts = [r for m in provider.mx.messages for r in m.rcpt_tos]
    assert len(rcpts) == len(set(rcpts)) == count + 1
    assert rcpts.index("r@example.net") < 50  # released last, delivered among the first
    assert urgent not in daemon.messages()
