"""Memory bounded by what is live (issue 31): each map of the delivery side forgets an
entry when its lifetime ends, and keeps a live one; `DeliveryManager.memory_sizes`."""

from __future__ import annotations

import asyncio
import ssl
from types import SimpleNamespace

import msgspec

from mtaqueue import config
from mtaqueue.config import DEFAULT_CLASSES
from mtaqueue.delivery import registry as registry_module
from mtaqueue.delivery.destination import DOMAINS_KEPT
from mtaqueue.delivery.manager import DeliveryManager
from mtaqueue.delivery.mta_sts import FETCH_RETRY, Policies
from mtaqueue.delivery.registry import Registry
from mtaqueue.model import Message, Recipient
from mtaqueue.policy import pipelining, rate_learner, warmup
from mtaqueue.policy.buckets import TokenBucket
from mtaqueue.policy.egress import EgressState
from mtaqueue.policy.hosts import HostSuspensions
from mtaqueue.policy.mta_sts import Policy
from mtaqueue.policy.pipelining import OutOfStep
from mtaqueue.routing.pools import Source
from mtaqueue.routing.resolver import MxHost, Resolver, Route
from mtaqueue.scheduler.active import ActiveWindow
from mtaqueue.scheduler.core import Scheduler
from mtaqueue.spool.store import Spool

T0 = 1_000_000.0
DAY = 86400.0
ROUTE = Route((MxHost("mx1.example.net", 10, ("127.0.0.2",)),), 25)
CLASSES = {name: (c.priority, c.weight) for name, c in DEFAULT_CLASSES.items()}


def registry(messages: dict) -> Registry:
    core = Scheduler(CLASSES, max_connections=10, connection_idle=5.0)
    reg = Registry(core, SimpleNamespace(messages=messages))  # type: ignore[arg-type]
    reg.configure(config.Config(), {}, {}, T0)
    return reg


def message(message_id: str, *addresses: str) -> Message:
    return Message(message_id, "a@b", tuple(Recipient(a) for a in addresses), T0, 10, "p2")


# -- delivery/registry.py ----------------------------------------------------------------


def test_a_busy_destination_forgets_the_mail_that_left_the_queue():
    messages = {"m1": message("m1", "x@example.org")}
    reg = registry(messages)
    d = reg.create("mx1.example.net", "example.org", ROUTE, None, T0)
    d.domains.add("example.org")
    d.waiting |= {"m1", "m3"}  # m3: bounced, expired or deleted, gone from the spool
    reg.tidy(d)
    assert d.waiting == {"m1"}  # still in the queue (delivered here: dropped as settled)
    assert d.domains == {"example.org"}  # under DOMAINS_KEPT: all kept


def test_a_destination_past_domains_kept_keeps_those_with_mail_there():
    messages = {"m1": message("m1", "x@c.example")}
    reg = registry(messages)
    d = reg.create("mx1.example.net", "a.example", ROUTE, None, T0)
    d.domains |= {"a.example", "b.example", "c.example", "d.example"}
    d.waiting.add("m1")
    d.domains_cap = 3  # as if DOMAINS_KEPT were 3
    reg.tidy(d)
    assert d.domains == {"a.example", "c.example"}  # the pacing domain, and m1's
    assert d.domains_cap == DOMAINS_KEPT  # the next cut: past twice what this one kept


def test_a_standing_steer_goes_when_its_time_is_over():
    reg = registry({})
    reg.steer("ended.example", lambda shaper, now: None, T0, until=T0 + 60)
    reg.steer("standing.example", lambda shaper, now: None, T0)
    reg.steer("later.example", lambda shaper, now: None, T0, until=T0 + 3600)
    reg.prune(T0 + 61)
    assert reg.sizes()["steers"] == 2
    reg.create("mx1.example.net", "later.example", ROUTE, None, T0 + 62)  # still applies


def test_learned_past_its_cap_keeps_the_latest_and_the_file_agrees(monkeypatch):
    monkeypatch.setattr(registry_module, "LEARNED_KEPT", 2)
    reg = registry({})
    for i, at in enumerate((T0 - 300, T0 - 100, T0 - 200)):
        reg.learned[f"mx{i}.example.net"] = rate_learner.Learned(5.0, good=4.0, at=at)
    reg.learned["old.example.net"] = rate_learner.Learned(5.0, good=4.0, at=T0 - 8 * DAY)
    reg.create("live.example.net", "live.example", ROUTE, None, T0)  # not counted
    saved, _ = rate_learner.decode(reg.learned_data(T0))
    remembered = set(reg.learned) - {"live.example.net"}
    assert remembered == {"mx1.example.net", "mx2.example.net"}  # old: FORGET, 7 days
    assert saved == reg.learned


# -- policy/pipelining.py, policy/hosts.py ----------------------------------------------


def test_out_of_step_hosts_are_dropped_after_forget_and_capped(monkeypatch):
    hosts = OutOfStep()
    hosts.learned("192.0.2.1", T0)
    hosts.learned("192.0.2.2", T0 + pipelining.FORGET / 2)
    assert hosts.state(T0 + pipelining.FORGET) == {"192.0.2.2": T0 + pipelining.FORGET / 2}
    assert len(hosts) == 1  # pruned, not only skipped
    monkeypatch.setattr(pipelining, "KEPT", 2)
    hosts.learned("192.0.2.3", T0 + 1)
    hosts.learned("192.0.2.4", T0 + 2)
    assert len(hosts) == 2 and not hosts.lockstep("192.0.2.2", T0 + 3)  # the oldest went


def test_a_host_released_long_ago_is_pruned_and_a_suspended_one_stays():
    hosts = HostSuspensions(60.0, 600.0)
    hosts.failed("old.example", T0)
    hosts.failed("now.example", T0 + 1000)
    hosts.prune(T0 + 1001)
    assert len(hosts) == 1 and hosts.suspended("now.example", T0 + 1001)


# -- delivery/mta_sts.py ----------------------------------------------------------------


def test_expired_policies_and_past_failure_marks_leave_the_cache(monkeypatch):
    sts = Policies(config.MtaStsConfig(), ssl.create_default_context(), None, None)  # type: ignore[arg-type]
    sts._cache = {
        "old.example": Policy("1", "enforce", ("mx.old.example",), 86400, T0 - 86400),
        "new.example": Policy("1", "enforce", ("mx.new.example",), 86400, T0 - 60),
    }
    sts._failed = {"down.example": T0 - 1, "still.example": T0 + FETCH_RETRY}
    sts.prune(T0)
    assert sts.sizes() == {"mta_sts_policies": 1, "mta_sts_failures": 1}
    assert set(sts._cache) == {"new.example"} and set(sts._failed) == {"still.example"}
    monkeypatch.setattr("mtaqueue.delivery.mta_sts.CACHE_KEPT", 1)
    sts._cache["newer.example"] = Policy("1", "testing", ("mx",), 86400, T0)
    sts.prune(T0)
    assert set(sts._cache) == {"newer.example"}  # the one fetched longest ago went


# -- policy/egress.py, policy/warmup.py -------------------------------------------------


def test_a_ramp_unused_for_a_month_goes_and_egress_json_agrees():
    egress = EgressState()
    source = Source("192.0.2.9", warmup=(50, 100))
    egress.warmup.ramp("idle.example", source, T0)
    egress.warmup.ramp("used.example", source, T0 + 20 * DAY)
    egress.exclude("used.example", source, T0, 3600.0)
    now = T0 + warmup.IDLE_DAYS * DAY
    saved = msgspec.json.decode(egress.encode(now))
    assert saved["warmup"].keys() == {"used.example@192.0.2.9"}
    assert saved["excluded"] == {}  # its hold ended
    assert egress.sizes() == {"egress_exclusions": 0, "ipv4_only": 0, "warmup_ramps": 1}


# -- scheduler/active.py, scheduler/slots.py, policy/buckets.py -------------------------


def test_waits_and_refusals_of_mail_gone_are_forgotten():
    active = ActiveWindow(10)
    active.uncharged_wait("gone")
    active.refused("gone", 1)
    active.uncharged_wait("live")
    active.prune({"live"})
    assert active.sizes()["active_waits"] == 1
    assert not active.uncharged_wait("live")  # its count kept: a repeat is charged


def test_a_full_tenant_bucket_is_dropped_and_one_in_debt_stays():
    core = Scheduler(CLASSES, max_connections=10, connection_idle=5.0, tenant_rate=1.0)
    admission = core.admission
    admission._bucket("idle", T0).take(T0)
    admission._bucket("busy", T0 + 10).take(T0 + 10)
    admission.prune(T0 + 10.5)
    assert admission.sizes()["tenant_buckets"] == 1 and "busy" in admission._tenants


def test_a_bucket_is_full_once_it_refilled():
    bucket = TokenBucket(2.0, 1, T0)
    assert bucket.full(T0)
    bucket.take(T0)
    assert not bucket.full(T0 + 0.1) and bucket.full(T0 + 0.5)


# -- delivery/manager.py ----------------------------------------------------------------


def test_memory_sizes_names_every_map_and_the_sweep_prunes_them(tmp_path):
    async def main() -> dict[str, int]:
        spool = Spool(tmp_path, min_free=lambda total: 0, compact_size=1 << 20, dedupe_window=1)
        resolver = Resolver(
            [("127.0.0.1", 53)],
            timeout=1.0,
            negative_ttl_max=60.0,
            max_addresses=2,
            address_order="ipv4-first",
        )
        manager = DeliveryManager(config.Config(), spool, resolver, "mx.test")
        manager.upkeep.prune(T0)  # the sweep's reach into every room, wired
        return manager.memory_sizes()

    sizes = asyncio.run(main())
    assert set(sizes) == {
        "destinations",
        "destination_messages",
        "destination_domains",
        "learned",
        "steers",
        "pipelining_hosts",
        "stations",
        "tenant_buckets",
        "active_messages",
        "active_waits",
        "mta_sts_policies",
        "mta_sts_failures",
        "egress_exclusions",
        "ipv4_only",
        "warmup_ramps",
        "host_suspensions",
        "tls_report_tallies",
        "warm_waits",
        "revalidation_passes",
        "latency_rounds",
    }
    assert all(count == 0 for count in sizes.values())
