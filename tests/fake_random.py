"""Random number sources for tests that need to pin jitter to one end of its range."""

from __future__ import annotations

import random


class Edge(random.Random):
    """A Random whose uniform() always returns one end of the range."""

    def __init__(self, end: str) -> None:
        super().__init__(0)
        self.end = end

    def uniform(self, a: float, b: float) -> float:
        return a if self.end == "low" else b


LOW, HIGH = Edge("low"), Edge("high")
