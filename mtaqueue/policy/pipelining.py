"""Hosts that answer pipelined commands out of step: spoken to in lock-step from then on.

    OutOfStep()
    .learned(ip, now)          a session with `ip` got replies out of step (smtp/pipeline.py)
    .lockstep(ip, now) -> bool  speak to it one command at a time
    .state(now) -> {ip: since}  for learned.json (rate_learner.encode); old ones dropped
    .restore({ip: since})
    len(out_of_step)           hosts remembered

Such a server would have a reply taken for another command's, so it is not trusted with a
pipelined group again, here or after a restart (learned.json keeps it like the learned
limits). After FORGET a fixed server gets pipelining back; one still broken is caught
again at its first group, before any content goes. Hosts are dropped after FORGET at
each `state` (the upkeep's sweep saves learned.json every 30 s), and at most KEPT are
remembered (the one learned longest ago goes first). Pure: `now` is passed in.
"""

from __future__ import annotations

FORGET = 30 * 86400.0
KEPT = 50_000  # hosts remembered at most: lock-step is rare, a flood of them is not ours


class OutOfStep:
    def __init__(self) -> None:
        self._hosts: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._hosts)

    def learned(self, ip: str, now: float) -> None:
        self._hosts.pop(ip, None)  # (kept in the order learned: the oldest first)
        self._hosts[ip] = now
        if len(self._hosts) > KEPT:
            del self._hosts[next(iter(self._hosts))]

    def lockstep(self, ip: str, now: float) -> bool:
        since = self._hosts.get(ip)
        return since is not None and now - since < FORGET

    def state(self, now: float) -> dict[str, float]:
        self._hosts = {ip: t for ip, t in self._hosts.items() if now - t < FORGET}
        return dict(sorted(self._hosts.items()))

    def restore(self, hosts: dict[str, float]) -> None:
        self._hosts = dict(sorted(hosts.items(), key=lambda entry: entry[1])[-KEPT:])
