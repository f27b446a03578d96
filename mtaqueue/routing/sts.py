"""`Applied`: a recipient domain's MTA-STS policy as its route carries it (resolver.Route.sts).

A value only: policy/mta_sts.py decides which policy applies and what it requires of each MX
host; delivery/mta_sts.py looks it up and restricts the route to the hosts it allows.
"""

from __future__ import annotations

import msgspec


class Applied(msgspec.Struct, frozen=True):
    """A domain's policy as a route carries it (resolver.Route.sts)."""

    domain: str
    mode: str  # ENFORCE or TESTING (policy/mta_sts.py)
    mx: tuple[str, ...]
    id: str
    max_age: int = 0  # seconds (a TLS-RPT report quotes the policy)
