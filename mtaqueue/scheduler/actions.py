"""The actions the scheduler core returns, for its driver to perform.

Dispatch(message_ids)          route these due messages, then `enqueue` their work
Connect(conn, destination, item, first_class)
                               open one connection for `item`; report `connected`
                               or `connect_failed`
Send(conn, item)               send `item` on open connection `conn`; report `done`
Close(conn)                    QUIT `conn` (its slot is free already)
GiveUp(conn, item)             no further host for `item` now: settle it
Release(destination, items)    a probe closed the circuit: let these go, spread out
Wake(at)                       call `tick` at `at` (replaces any earlier Wake)
Action                         the union of them
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Dispatch:
    """These messages are due: route their pending recipients (then `enqueue`)."""

    message_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Connect(Generic[T]):
    """Open one connection (to the next host not tried yet) for `item`, then report
    `connected` or `connect_failed`."""

    conn: int
    destination: str
    item: T
    first_class: bool  # a reserved slot: it carries first-class work only


@dataclass(frozen=True, slots=True)
class Send(Generic[T]):
    """Send `item` on the open connection `conn`, then report `done`."""

    conn: int
    item: T


@dataclass(frozen=True, slots=True)
class Close:
    """Close `conn` (QUIT); its slot is free already."""

    conn: int


@dataclass(frozen=True, slots=True)
class GiveUp(Generic[T]):
    """No further host may be tried for `item` now (the breaker opened, the slot is no
    longer admitted): settle it with the connect failures it met. Its slot is free."""

    conn: int
    item: T


@dataclass(frozen=True, slots=True)
class Release(Generic[T]):
    """A probe closed `destination`'s circuit: the items that waited while it was open,
    most urgent first, taken out of its queue for the driver to let go spread out (not
    as a herd)."""

    destination: str
    items: tuple[T, ...]


@dataclass(frozen=True, slots=True)
class Wake:
    """Call `tick` at `at` (replaces any earlier Wake; none: nothing is timed)."""

    at: float


Action = Dispatch | Connect | Send | Close | GiveUp | Release | Wake
