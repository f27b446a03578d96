"""systemd's notify protocol without libsystemd: one datagram per state change.

READY=1 once listeners are bound and the queue is loaded, STOPPING=1 when a stop
begins, STATUS= lines for `systemctl status`, and WATCHDOG=1 from the event loop
(every half of WatchdogSec, while the daemon says it is healthy) so that a stalled
loop, or a spool that no longer commits, gets the service restarted.
Outside systemd ($NOTIFY_SOCKET unset) every call does nothing.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self.address = address
        self.watchdog_interval = self._watchdog(env)

    @staticmethod
    def _watchdog(env) -> float | None:
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        return int(usec) / 1_000_000 / 2

    def send(self, *lines: str) -> bool:
        if not self.address:
            return False
        # A plain socket, not an asyncio endpoint (uvloop#403: unconnected AF_UNIX
        # datagram endpoints fail); sendto on a datagram socket does not block.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.sendto("\n".join(lines).encode(), self.address)
            except OSError:
                return False
        return True

    async def watchdog(self, healthy: Callable[[], bool]) -> None:
        """Ping systemd from the loop while healthy(); a loop stuck, or unhealthy, for
        WatchdogSec gets us restarted."""
        if self.watchdog_interval is None:
            return
        while True:
            if healthy():
                self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)
