"""Which waiting item goes next: strict priority for the first class, weights for the rest,
round-robin for tenants.

The first class (the lowest priority number, p0: password resets, 2FA; a tie goes to the
name that sorts first, see `class_order`) always goes first.
The other classes share what is left by weight, with stride scheduling: each class has a
virtual time that advances by 1/weight per item served and the class furthest behind goes
next (ties: lower priority number). Weights p1=4, p2=1 give four p1 for each p2 while both
wait, and a class alone gets everything: bulk is slowed, never starved. A class that was
idle rejoins at the current virtual time, so it cannot bank credit for a burst.

Within a class, tenants (the submitting apps) take turns, FIFO within a tenant: a tenant
with 1000 items waiting does not hold up another's one. A tenant's rate cap lives with the
caller (a `TokenBucket` per tenant); `pop(eligible=...)` skips tenants that are over it,
leaving their items in place.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")
Tenant = str | None


def class_order(priorities: Mapping[str, int]) -> list[str]:
    """Class names by priority, ties by name: the one order everything uses (the queue,
    the first class's restart and retry treatment, the submission's listing), so that
    two classes with the same priority cannot each be "the first class" somewhere."""
    return sorted(priorities, key=lambda name: (priorities[name], name))


class FairQueue(Generic[T]):
    def __init__(self, classes: dict[str, tuple[int, int]]) -> None:
        """`classes`: name -> (priority, weight); the lowest priority is the first class."""
        if not classes:
            raise ValueError("a fair queue needs at least one class")
        if min(weight for _, weight in classes.values()) < 1:
            raise ValueError("class weights must be at least 1")
        order = class_order({name: priority for name, (priority, _) in classes.items()})
        self._first = order[0]
        self._others = order[1:]  # by priority, which breaks ties between equal shares
        # Integer strides (lcm / weight) keep the virtual times exact however long it runs.
        lcm = math.lcm(*(weight for _, weight in classes.values()))
        self._stride = {name: lcm // weight for name, (_, weight) in classes.items()}
        self._pass = dict.fromkeys(classes, 0)
        self._clock = 0  # the virtual time of the last item served from the other classes
        # class -> tenant -> items; a dict's order is the tenants' turn order
        self._queues: dict[str, dict[Tenant, deque[T]]] = {name: {} for name in classes}
        self._depth = dict.fromkeys(classes, 0)

    def push(self, item: T, klass: str, tenant: Tenant = None) -> None:
        if klass not in self._queues:
            raise ValueError(f"unknown class {klass!r}")
        self._queues[klass].setdefault(tenant, deque()).append(item)
        self._depth[klass] += 1

    def put_back(self, item: T, klass: str, tenant: Tenant = None) -> None:
        """An item taken by `pop` that did not go: at the head of its tenant's queue, the
        tenant first in turn in its class, as if it had not been taken."""
        tenants = self._queues[klass]
        items = tenants.pop(tenant, deque())
        items.appendleft(item)
        self._queues[klass] = {tenant: items, **tenants}
        self._depth[klass] += 1

    def pop(
        self,
        *,
        first_class_only: bool = False,
        eligible: Callable[[Tenant], bool] | None = None,
    ) -> T | None:
        """The next item, or None. `first_class_only`: only the first class (a reserved
        slot is being used). `eligible`: tenants for which it says False wait this turn."""
        item = self._pop_from(self._first, eligible)
        if item is not None or first_class_only:
            return item
        waiting = [name for name in self._others if self._ready(name, eligible)]
        if not waiting:
            return None
        klass = min(waiting, key=lambda name: max(self._pass[name], self._clock))
        self._clock = max(self._pass[klass], self._clock)
        self._pass[klass] = self._clock + self._stride[klass]
        return self._pop_from(klass, eligible)

    def __len__(self) -> int:
        return sum(self._depth.values())

    def depth(self) -> dict[str, int]:
        """Items waiting by class, every class listed."""
        return dict(self._depth)

    def first_class_waiting(self) -> bool:
        return self._depth[self._first] > 0

    def remove(self, predicate: Callable[[T], bool]) -> list[T]:
        """Take out the items that match (to hold them): by class priority, then tenant
        turn, then FIFO."""
        removed: list[T] = []
        for klass in (self._first, *self._others):
            tenants = self._queues[klass]
            for tenant, items in list(tenants.items()):
                kept: deque[T] = deque()
                for item in items:
                    (removed if predicate(item) else kept).append(item)
                self._depth[klass] -= len(items) - len(kept)
                if kept:
                    tenants[tenant] = kept
                else:
                    del tenants[tenant]
        return removed

    def _ready(self, klass: str, eligible: Callable[[Tenant], bool] | None) -> bool:
        tenants = self._queues[klass]
        return any(eligible(t) for t in tenants) if eligible else bool(tenants)

    def _pop_from(self, klass: str, eligible: Callable[[Tenant], bool] | None) -> T | None:
        tenants = self._queues[klass]
        for tenant in tenants:  # the first in turn that may go
            if eligible is None or eligible(tenant):
                break
        else:
            return None
        items = tenants.pop(tenant)
        item = items.popleft()
        if items:
            tenants[tenant] = items  # to the back of the turn order
        self._depth[klass] -= 1
        return item
