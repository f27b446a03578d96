"""The gauges that show where memory goes: each process's resident size, the daemon's
asyncio tasks, and the entries of every in-memory map that could grow.

    memory_families(processes, sizes) -> Iterator[Metric]
        processes: {"daemon": pid, "writer": pid}; sizes: {map name: entries}

A dashboard plots mtaqueue_process_resident_bytes beside mtaqueue_queue_messages: memory
should follow the queue, not the calendar. When it does not, mtaqueue_memory_entries names
the map that grows (docs/architecture.md, "What is kept in memory, and for how long"), and
the memory_growing alert rule (alerts.py) fires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

from .process_stats import resident_bytes


def memory_families(processes: Mapping[str, int], sizes: Mapping[str, int]) -> Iterator[Metric]:
    resident = GaugeMetricFamily(
        "mtaqueue_process_resident_bytes",
        "Resident memory (RSS) of each of mtaqueue's processes: the daemon, the spool writer",
        labels=("process",),
    )
    for name, pid in sorted(processes.items()):
        resident.add_metric((name,), resident_bytes(pid))
    yield resident
    yield GaugeMetricFamily(
        "mtaqueue_process_tasks",
        "asyncio tasks of the daemon (flat at a steady load)",
        value=len(asyncio.all_tasks()),
    )
    entries = GaugeMetricFamily(
        "mtaqueue_memory_entries",
        "Entries of each in-memory map that remembers something for a while, by map",
        labels=("map",),
    )
    for name, count in sorted(sizes.items()):
        entries.add_metric((name,), count)
    yield entries
