"""heap.trim: what the C heap freed below a live block goes back to the kernel."""

from __future__ import annotations

from mtaqueue import heap
from mtaqueue.process_stats import resident_bytes


def test_a_trim_gives_back_what_was_freed_below_a_live_block():
    blocks = [bytes(2048) for _ in range(20_000)]  # ~40 MB of malloc'd blocks (over 512 B)
    above = [bytes(2048) for _ in range(10)]  # still live, above them: the top stays put
    del blocks
    before = resident_bytes("self")
    heap.trim()
    after = resident_bytes("self")
    assert before - after > 20e6, (before, after)
    assert len(above) == 10
