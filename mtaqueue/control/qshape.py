"""qshape: the queue by domain (or sender, tenant) and age, as Postfix's qshape shows it.

Rows: the busiest N keys and a TOTAL row; columns: messages younger than 5, 10, 20,
40, ... 1280 minutes, and older. An admin sees at a glance which destination backs
up, and since when. Pure: `now` and the messages are passed in.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ..model import FINAL_STATES, Message

BUCKETS = (5, 10, 20, 40, 80, 160, 320, 640, 1280)  # upper bounds, minutes
LABELS = [*map(str, BUCKETS), "1280+"]


class QShape:
    """The table, a message at a time (a walk over a large queue yields between chunks)."""

    def __init__(self, now: float, *, by: str = "domain", klass: str | None = None) -> None:
        self.now = now
        self.by = by
        self.klass = klass
        self._rows: dict[str, list[int]] = defaultdict(lambda: [0] * len(LABELS))
        self._total = [0] * len(LABELS)

    def add(self, message: Message) -> None:
        """By domain a message counts once per recipient domain it still has pending
        recipients in (as Postfix counts recipients' domains); by sender or tenant, once."""
        if self.klass is not None and message.klass != self.klass:
            return
        keys = _keys(message, self.by)
        if not keys:
            return
        column = _column((self.now - message.created) / 60)
        self._total[column] += 1
        for key in keys:
            self._rows[key][column] += 1

    def rows(self, top: int = 20) -> list[dict]:
        """Rows {"key", "total", "buckets": [counts per LABELS]}, TOTAL first."""
        rows = self._rows
        ranked = Counter({key: sum(counts) for key, counts in rows.items()}).most_common(top)
        result = [{"key": "TOTAL", "total": sum(self._total), "buckets": self._total}]
        result += [{"key": key, "total": count, "buckets": rows[key]} for key, count in ranked]
        return result


def _keys(message: Message, by: str) -> set[str]:
    pending = [r for r in message.recipients if r.state not in FINAL_STATES]
    if not pending:
        return set()
    if by == "sender":
        return {message.sender.rpartition("@")[2].lower() or "<>"}
    if by == "tenant":
        return {message.tenant or "-"}
    return {r.address.rpartition("@")[2].lower() for r in pending}


def _column(age_minutes: float) -> int:
    for i, bound in enumerate(BUCKETS):
        if age_minutes < bound:
            return i
    return len(BUCKETS)


def render(rows: list[dict]) -> str:
    """The familiar fixed-width table."""
    width = max([len(row["key"]) for row in rows] + [6])
    header = f"{'':>{width}} {'T':>6} " + " ".join(f"{label:>5}" for label in LABELS)
    lines = [header]
    for row in rows:
        cells = " ".join(f"{n:>5}" for n in row["buckets"])
        lines.append(f"{row['key']:>{width}} {row['total']:>6} {cells}")
    return "\n".join(lines) + "\n"
