"""Idempotency keys seen: dedupe key -> (queue id, created), forgotten as windows close.

    keys = KeyIndex()
    keys.keep(key, queue_id, created)   # the newest message holding a key keeps it
    keys.get(key) -> (queue id, created) | None;  len(keys); iteration; keys == {...}
    keys.forget_before(t)               # drop keys created before t (expiring.py)

A key lives for the dedupe window after its message was created, whatever became of the
message, so the index holds what the window holds: at 25 keyed messages a second and the
24 h default, about two million keys (docs/operations.md gives the cost per key).
"""

from __future__ import annotations

from .expiring import Expiring


def _created(held: tuple[str, float]) -> float:
    return held[1]


class KeyIndex(Expiring[str, tuple[str, float]]):
    def __init__(self) -> None:
        super().__init__(_created)

    def keep(self, key: str, queue_id: str, created: float) -> None:
        # Once a window has passed, the same key may be accepted again as a new message.
        # A later update of the older message must not take the key back, so the newest
        # message holding a key keeps it, whatever the record order.
        # The same holder again (each update of its message is a Put) changes nothing:
        # setting it would file the key under its slice once more.
        held = self.get(key)
        if held is None or (created, queue_id) > (held[1], held[0]):
            self[key] = (queue_id, created)
