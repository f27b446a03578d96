"""Priorities, weights and tenant fairness (mtaqueue.policy.fairness)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtaqueue.config import DEFAULT_CLASSES
from mtaqueue.policy.fairness import FairQueue, class_order

CLASSES = {name: (c.priority, c.weight) for name, c in DEFAULT_CLASSES.items()}  # p1:p2 = 4:1


@pytest.fixture
def queue() -> FairQueue[tuple[str, str | None, int]]:
    return FairQueue(CLASSES)


def fill(queue, klass, count, tenant=None):
    for i in range(count):
        queue.push((klass, tenant, i), klass, tenant)


def drain(queue, **kwargs):
    items = []
    while (item := queue.pop(**kwargs)) is not None:
        items.append(item)
    return items


def test_the_default_weights_are_four_to_one():
    assert CLASSES == {"p0": (0, 1), "p1": (1, 4), "p2": (2, 1)}


def test_a_tie_for_the_first_class_goes_to_the_name_that_sorts_first():
    classes = {**CLASSES, "a": (0, 1)}  # as [classes.a] priority = 0 makes it
    assert class_order({name: p for name, (p, _) in classes.items()}) == ["a", "p0", "p1", "p2"]
    queue = FairQueue(classes)
    fill(queue, "p0", 2)
    fill(queue, "a", 2)
    assert [klass for klass, _, _ in drain(queue, first_class_only=True)] == ["a", "a"]


def test_empty(queue):
    assert queue.pop() is None
    assert len(queue) == 0
    assert queue.depth() == {"p0": 0, "p1": 0, "p2": 0}
    assert not queue.first_class_waiting()


def test_the_first_class_always_goes_first(queue):
    fill(queue, "p2", 10)
    fill(queue, "p1", 10)
    fill(queue, "p0", 3)
    assert [queue.pop()[0] for _ in range(3)] == ["p0"] * 3
    queue.pop()
    fill(queue, "p0", 1)  # arriving later, still next
    assert queue.pop()[0] == "p0"


def test_p1_and_p2_share_four_to_one(queue):
    fill(queue, "p1", 2000)
    fill(queue, "p2", 2000)
    served = Counter(queue.pop()[0] for _ in range(1000))
    assert served["p1"] == pytest.approx(800, abs=5)
    # And over any short stretch too: never more than 4 p1 in a row.
    run = longest = 0
    for _ in range(500):
        run = run + 1 if queue.pop()[0] == "p1" else 0
        longest = max(longest, run)
    assert longest <= 4


def test_bulk_alone_gets_everything(queue):
    fill(queue, "p2", 50)
    assert [item[2] for item in drain(queue)] == list(range(50))


def test_bulk_is_slowed_not_starved(queue):
    fill(queue, "p2", 100)
    served = Counter()
    for i in range(500):
        queue.push(("p1", None, i), "p1")  # transactional mail keeps coming
        served[queue.pop()[0]] += 1
    assert served["p2"] == pytest.approx(100, abs=5)


def test_an_idle_class_banks_no_credit(queue):
    fill(queue, "p2", 200)
    drain_some = [queue.pop() for _ in range(100)]  # p2 alone for a while
    assert {item[0] for item in drain_some} == {"p2"}
    fill(queue, "p1", 100)
    # p1 arriving does not shut p2 out to catch up on the time it was away.
    assert Counter(queue.pop()[0] for _ in range(20))["p2"] == pytest.approx(4, abs=1)


def test_tenants_take_turns(queue):
    fill(queue, "p1", 1000, tenant="big")
    queue.push(("p1", "small", 0), "p1", "small")
    first_two = [queue.pop()[1] for _ in range(2)]
    assert "small" in first_two


def test_tenants_take_turns_in_the_first_class_too(queue):
    fill(queue, "p0", 100, tenant="a")
    fill(queue, "p0", 2, tenant="b")
    assert [queue.pop()[1] for _ in range(4)] == ["a", "b", "a", "b"]


def test_an_item_put_back_goes_next_as_if_not_taken(queue):
    fill(queue, "p2", 3, tenant="a")
    fill(queue, "p2", 3, tenant="b")
    taken = queue.pop()
    assert taken == ("p2", "a", 0)
    queue.put_back(taken, "p2", "a")
    assert len(queue) == 6 and queue.depth()["p2"] == 6
    assert [queue.pop() for _ in range(3)] == [("p2", "a", 0), ("p2", "b", 0), ("p2", "a", 1)]


def test_fifo_within_a_tenant(queue):
    fill(queue, "p1", 5, tenant="a")
    fill(queue, "p1", 5, tenant="b")
    items = drain(queue)
    for tenant in ("a", "b"):
        assert [i for _, t, i in items if t == tenant] == list(range(5))


def test_first_class_only(queue):
    fill(queue, "p1", 3)
    assert queue.pop(first_class_only=True) is None
    fill(queue, "p0", 1)
    assert queue.first_class_waiting()
    assert queue.pop(first_class_only=True)[0] == "p0"
    assert not queue.first_class_waiting()
    assert len(queue) == 3


def test_ineligible_tenants_wait(queue):
    fill(queue, "p0", 2, tenant="capped")
    fill(queue, "p1", 2, tenant="capped")
    fill(queue, "p2", 1, tenant="ok")
    items = drain(queue, eligible=lambda tenant: tenant != "capped")
    assert items == [("p2", "ok", 0)]
    assert queue.depth() == {"p0": 2, "p1": 2, "p2": 0}
    assert queue.pop(eligible=lambda tenant: True) == ("p0", "capped", 0)


def test_remove(queue):
    fill(queue, "p0", 3, tenant="a")
    fill(queue, "p1", 4, tenant="a")
    fill(queue, "p1", 4, tenant="b")
    fill(queue, "p2", 4, tenant="b")
    removed = queue.remove(lambda item: item[1] == "b" or item[2] == 0)
    assert removed == [("p0", "a", 0), ("p1", "a", 0)] + [("p1", "b", i) for i in range(4)] + [
        ("p2", "b", i) for i in range(4)
    ]
    assert len(queue) == 5
    assert queue.depth() == {"p0": 2, "p1": 3, "p2": 0}
    assert drain(queue) == [("p0", "a", 1), ("p0", "a", 2)] + [("p1", "a", i) for i in (1, 2, 3)]
    assert queue.remove(lambda item: True) == []


def test_unknown_class(queue):
    with pytest.raises(ValueError, match="unknown class"):
        queue.push("x", "p9")


def test_invalid_classes():
    with pytest.raises(ValueError):
        FairQueue({})
    with pytest.raises(ValueError):
        FairQueue({"a": (0, 1), "b": (1, 0)})


def test_more_classes_by_weight():
    queue = FairQueue({"urgent": (0, 1), "a": (1, 3), "b": (2, 2), "c": (3, 1)})
    for klass in ("a", "b", "c"):
        fill(queue, klass, 600)
    served = Counter(queue.pop()[0] for _ in range(600))
    assert served == {"a": 300, "b": 200, "c": 100}


class Queue(RuleBasedStateMachine):
    """Random pushes, pops and removals: nothing lost or duplicated, the first class first,
    FIFO within each class and tenant, and the counts right."""

    CLASS_NAMES = ("p0", "p1", "p2")
    TENANTS = (None, "a", "b")

    def __init__(self) -> None:
        super().__init__()
        self.queue: FairQueue[int] = FairQueue(CLASSES)
        self.waiting: dict[int, tuple[str, str | None]] = {}
        self.next_id = 0

    @rule(klass=st.sampled_from(CLASS_NAMES), tenant=st.sampled_from(TENANTS))
    def push(self, klass, tenant):
        self.queue.push(self.next_id, klass, tenant)
        self.waiting[self.next_id] = (klass, tenant)
        self.next_id += 1

    @rule(first_class_only=st.booleans())
    def pop(self, first_class_only):
        item = self.queue.pop(first_class_only=first_class_only)
        first_waiting = any(k == "p0" for k, _ in self.waiting.values())
        if item is None:
            assert not first_waiting if first_class_only else not self.waiting
            return
        klass, tenant = self.waiting.pop(item)
        if first_waiting or first_class_only:
            assert klass == "p0"
        # FIFO within a class and tenant: nothing older of the same pair still waits.
        assert not any(i < item and kt == (klass, tenant) for i, kt in self.waiting.items())

    @precondition(lambda self: self.waiting)
    @rule(modulus=st.integers(2, 5))
    def remove(self, modulus):
        removed = self.queue.remove(lambda item: item % modulus == 0)
        expected = sorted(i for i in self.waiting if i % modulus == 0)
        assert sorted(removed) == expected
        for item in removed:
            del self.waiting[item]

    @invariant()
    def counts(self):
        assert len(self.queue) == len(self.waiting)
        assert self.queue.depth() == {
            k: sum(kt[0] == k for kt in self.waiting.values()) for k in self.CLASS_NAMES
        }
        assert self.queue.first_class_waiting() == any(k == "p0" for k, _ in self.waiting.values())


TestQueue = Queue.TestCase
