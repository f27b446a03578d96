"""CPU that a benchmark round costs: the whole machine's and named processes' (Linux /proc).

    meter = CpuMeter({"daemon": pid, "writer": pid2})   # a snapshot, now
    use = meter.read()                                  # CpuUse since the snapshot
    use.line(messages) -> str                           # CPU a message, for the round's print
    cpu_seconds(pid) -> float | None                    # a process's CPU so far (None: gone)

The machine's busy CPU (user, system, interrupts, steal) and idle share come from
/proc/stat; a process's own CPU (user and system) from /proc/PID/stat; the CPU of this
process's children that ended meanwhile (smtp-source, run to completion in a round) from
getrusage. A process gone by the read counts 0.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuUse:
    seconds: float  # wall clock
    busy: float  # CPU-s of the whole machine
    idle: float  # CPU-s idle (iowait included)
    processes: dict[str, float]  # name -> CPU-s
    children: float  # CPU-s of this process's children that ended (smtp-source)

    def line(self, messages: int) -> str:
        """CPU a message in milliseconds: the machine's (and its idle share), then each
        process's (and its share of the round's wall clock: 100 % is one core's all)."""
        share = self.idle / (self.busy + self.idle) if self.busy + self.idle else 0.0
        parts = [f"machine {1000 * self.busy / messages:.2f} ms ({share:.0%} idle)"]
        parts += [
            f"{name} {1000 * cpu / messages:.2f} ({cpu / self.seconds:.0%})"
            for name, cpu in self.processes.items()
        ]
        if self.children:
            parts.append(f"smtp-source {1000 * self.children / messages:.2f}")
        return "CPU a message: " + ", ".join(parts)


class CpuMeter:
    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start = time.monotonic()
        self._machine = _machine()
        self._first = {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
        self._children = _children()

    def read(self) -> CpuUse:
        busy, idle = (b - a for a, b in zip(self._machine, _machine(), strict=True))
        now = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        return CpuUse(
            seconds=time.monotonic() - self._start,
            busy=busy,
            idle=idle,
            processes={
                name: 0.0 if cpu is None else cpu - self._first[name] for name, cpu in now.items()
            },
            children=_children() - self._children,
        )


def _machine() -> tuple[float, float]:
    """(busy, idle) CPU-s of the machine since boot."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / TICK, (idle + iowait) / TICK


def cpu_seconds(pid: int | None) -> float | None:
    """A process's own CPU-s (user and system) so far; None if there is none to read."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICK


def _children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
