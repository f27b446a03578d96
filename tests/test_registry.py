"""The live destinations (delivery/registry.py) with a real scheduler core: an operator's
name, standing limits, retiring, and what destinations taught."""

from __future__ import annotations

from types import SimpleNamespace

from msgspec.structs import replace

from mtaqueue import config
from mtaqueue.config import DEFAULT_CLASSES
from mtaqueue.delivery.registry import Registry, named
from mtaqueue.model import Message, Recipient
from mtaqueue.policy import rate_learner
from mtaqueue.policy.pacing_rules import NAMED_HOP_RATE
from mtaqueue.routing.resolver import MxHost, Route
from mtaqueue.scheduler.core import Scheduler

T0 = 1_000_000.0
ROUTE = Route((MxHost("mx1.example.net", 10, ("127.0.0.2",)),), 25)
CLASSES = {name: (c.priority, c.weight) for name, c in DEFAULT_CLASSES.items()}


def registry(messages: dict | None = None) -> tuple[Registry, Scheduler]:
    core = Scheduler(CLASSES, max_connections=10, connection_idle=5.0)
    spool = SimpleNamespace(messages=messages if messages is not None else {})
    reg = Registry(core, spool)  # type: ignore[arg-type]  (only its index is read)
    reg.configure(config.Config(), {}, {}, T0)
    return reg, core


def test_an_operators_name_is_a_key_or_a_domain_it_serves():
    reg, _ = registry()
    d = reg.create("mx1.example.net", "example.org", ROUTE, None, T0)
    d.domains.add("example.org")
    assert named(d, "mx1.example.net") and named(d, "example.org")
    assert not named(d, "example.com")
    assert [x.key for x in reg.matching("example.org")] == ["mx1.example.net"]


def test_a_limit_applies_now_and_to_a_destination_that_appears_later():
    reg, _ = registry()
    seen = []
    keys = reg.steer("Example.ORG", lambda shaper, now: seen.append((shaper, now)), T0)
    assert keys == [] and seen == []  # none live yet
    d = reg.create("mx1.example.net", "example.org", ROUTE, None, T0 + 1)
    assert seen == [(d.shaper, T0 + 1)]  # the standing steer met it as it appeared


def test_a_quiet_destination_retires_and_keeps_what_it_learned():
    message = Message("m1", "a@b", (Recipient("x@example.org"),), T0, 10, "p2")
    messages = {"m1": message}
    reg, core = registry(messages)
    d = reg.create("mx1.example.net", "example.org", ROUTE, None, T0)
    d.domains.add("example.org")
    d.waiting.add("m1")
    reg.retire(d, T0)
    assert "mx1.example.net" in reg.destinations  # a message still waits for it
    del messages["m1"]
    reg.retire(d, T0)
    assert "mx1.example.net" not in reg.destinations
    assert "mx1.example.net" in reg.learned
    assert not core.forget("mx1.example.net")  # the core forgot it too


def test_forget_learned_drops_live_and_remembered_lessons():
    reg, _ = registry()
    lesson = reg.create("mx1.example.net", "example.org", ROUTE, None, T0).shaper.learned(T0)
    reg.learned["mx2.example.net"] = lesson
    assert reg.forget_learned("mx2.example.net", T0) == 1
    assert "mx2.example.net" not in reg.learned
    assert rate_learner.decode(reg.learned_data(T0))[0].keys() <= {"mx1.example.net"}


def test_a_next_hop_the_operator_named_starts_at_full_rate_an_own_mx_in_slow_start():
    reg, _ = registry()
    own = reg.create("mx1.example.net", "example.org", replace(ROUTE, own_mx=True), None, T0)
    named_hop = reg.create("127.0.0.1:2526", "example.org", ROUTE, None, T0)  # a relayhost
    assert not own.named_hop and named_hop.named_hop
    assert named_hop.shaper.snapshot(T0)["messages_per_minute"] == NAMED_HOP_RATE
    assert own.shaper.snapshot(T0)["messages_per_minute"] < NAMED_HOP_RATE / 100
    shaping = config.ShapingConfig()
    reloaded = config.Config(
        shaping=replace(shaping, default=replace(shaping.default, max_connections=3))
    )
    reg.configure(reloaded, {}, {}, T0 + 1)  # new pacing: a new shaper, what it learned kept
    assert named_hop.pacing.max_connections == 3
    assert named_hop.shaper.snapshot(T0 + 1)["messages_per_minute"] == NAMED_HOP_RATE
    assert own.shaper.snapshot(T0 + 1)["messages_per_minute"] < NAMED_HOP_RATE / 100
