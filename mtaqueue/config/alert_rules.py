"""[[alerts.rules]] tables: `AlertRule` is one of `OldestAge`, `DeferralRate`, `DepthGrowing`,
`SpoolFree`, `ReviewSize`, `ReviewOldestAge`, `WebhookBacklog`, `SenderBlocked`,
`MemoryGrowing`, picked by the `type` key.

Each rule has a `threshold`, the value its alert events quote; what the rules mean and how
they are evaluated is alerts.py's.
"""

from typing import Annotated

import msgspec

from .units import Duration, Size, duration, size


class _Rule(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"
):
    name: str = ""  # in events and the gauge; "" = the rule's type


class OldestAge(_Rule, frozen=True, kw_only=True, tag="oldest_age"):
    klass: str = msgspec.field(name="class")  # "*" = each class
    over: Duration

    @property
    def threshold(self) -> float:
        return self.over


class DeferralRate(_Rule, frozen=True, kw_only=True, tag="deferral_rate"):
    destination: str = "*"
    over: Annotated[float, msgspec.Meta(ge=0, le=1)]
    window: Duration
    # A handful of attempts says little: 1 deferral out of 1 is not a 100% problem.
    min_attempts: Annotated[int, msgspec.Meta(ge=1)] = 10

    @property
    def threshold(self) -> float:
        return self.over


class DepthGrowing(_Rule, frozen=True, kw_only=True, tag="depth_growing"):
    destination: str = "*"
    period: Duration = msgspec.field(name="for")
    over: Annotated[int, msgspec.Meta(ge=0)] = 0  # and only above this depth

    @property
    def threshold(self) -> float:
        return self.period


class SpoolFree(_Rule, frozen=True, kw_only=True, tag="spool_free"):
    under: Size

    @property
    def threshold(self) -> float:
        return self.under


class ReviewSize(_Rule, frozen=True, kw_only=True, tag="review_size"):
    over: Annotated[int, msgspec.Meta(ge=0)] = 0

    @property
    def threshold(self) -> float:
        return self.over


class ReviewOldestAge(_Rule, frozen=True, kw_only=True, tag="review_oldest_age"):
    over: Duration

    @property
    def threshold(self) -> float:
        return self.over


class WebhookBacklog(_Rule, frozen=True, kw_only=True, tag="webhook_backlog"):
    webhook: str = "*"
    over: Duration

    @property
    def threshold(self) -> float:
        return self.over


class SenderBlocked(_Rule, frozen=True, kw_only=True, tag="sender_blocked"):
    destination: str = "*"

    @property
    def threshold(self) -> float:
        return 0


class MemoryGrowing(_Rule, frozen=True, kw_only=True, tag="memory_growing"):
    process: str = "*"  # "daemon", "writer" or "*" = each
    over: Size = size("64MiB")  # grown by more than this over `for`
    period: Duration = msgspec.field(name="for", default=duration("6h"))

    @property
    def threshold(self) -> float:
        return self.over


AlertRule = (
    OldestAge
    | DeferralRate
    | DepthGrowing
    | SpoolFree
    | ReviewSize
    | ReviewOldestAge
    | WebhookBacklog
    | SenderBlocked
    | MemoryGrowing
)
