"""The tables of outbound delivery: delivery (`DeliveryConfig`, `TimeoutsConfig`, `ReplyRule`),
mta_sts (`MtaStsConfig`), tls_rpt (`TlsRptConfig`), shaping (`ShapingConfig`, `Pacing`,
`DestinationRule`, `ThrottleRule`), retry (`RetryConfig`), the next hops of classes and tenants
(`RelayConfig`, `ClassConfig`, `TenantConfig`, `DEFAULT_CLASSES`), pools (`PoolConfig`,
`SourceConfig`) and DKIM keys (`DkimKeyConfig`, `DKIM_HEADERS`, `dkim_path`).
"""

from typing import Annotated, Literal

import msgspec

from .table import Table
from .units import Duration, duration


class MtaStsConfig(Table):
    """MTA-STS (RFC 8461) for delivery to recipient domains' MX hosts."""

    enabled: bool = True
    ca_file: str = ""  # CAs that policy hosts and enforced MX certificates chain to; "" = system
    fetch_timeout: Duration = duration("10s")  # the whole HTTPS GET of a policy
    https_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 443  # of policy hosts (tests)


class TlsRptConfig(Table):
    """TLS-RPT (RFC 8460): daily reports of TLS results to the domains that ask for them."""

    enabled: bool = False  # reports go to the world: opt-in
    organization: str = ""  # organization-name; "" = listen.hostname
    contact: str = ""  # contact-info (an address or URL); "" = the `from` address
    sender: str = msgspec.field(default="", name="from")  # of mailto: reports; "" = postmaster@host


class TimeoutsConfig(Table):
    """Per-phase SMTP client timeouts (RFC 5321 4.5.3.2 minimums, Postfix's connect)."""

    connect: Duration = duration("30s")
    banner: Duration = duration("5m")
    ehlo: Duration = duration("5m")
    starttls: Duration = duration("5m")
    mail: Duration = duration("5m")
    rcpt: Duration = duration("5m")
    data_start: Duration = duration("2m")
    data_done: Duration = duration("10m")  # sending the content and waiting for the final reply


class ReplyRule(Table):
    """A site rule for replies, checked before the built-in classification."""

    match: str  # regex, searched in "CODE ENHANCED TEXT" (e.g. "421 4.7.0 Try again later")
    outcome: Literal["transient", "permanent"]
    kind: str = "policy"  # greylisting, throttling, mailbox, policy, content, ...
    phase: str = ""  # only replies in this phase ("" = any)


class DeliveryConfig(Table):
    enabled: bool = True  # false: accept and queue only (mail waits, like a paused transport)
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 25
    relayhost: str = ""  # "" = MX lookup per domain; else a next hop, see split_host_port()
    helo_name: str = ""  # "" = listen.hostname
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 100
    max_recipients_per_transaction: Annotated[int, msgspec.Meta(ge=1)] = 100
    connection_idle: Duration = duration("5s")  # keep a connection this long for the next message
    max_addresses: Annotated[int, msgspec.Meta(ge=1)] = 5  # addresses tried per attempt
    address_order: Literal["ipv4-first", "ipv6-first", "as-resolved"] = "ipv4-first"
    tls: Literal["opportunistic", "required", "off"] = "opportunistic"
    ambiguous: Literal["retry", "assume-delivered"] = "retry"
    host_suspend: Duration = duration("1m")
    host_suspend_max: Duration = duration("1h")
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    rules: list[ReplyRule] = []
    max_rate: str = ""  # over all destinations, e.g. "100/min"; "" = no cap


class Pacing(Table):
    """Limits of one destination; each key of a [[shaping.destinations]] entry overrides one."""

    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 10
    initial_connections: Annotated[int, msgspec.Meta(ge=1)] = 2  # adaptive: start here
    messages_per_connection: Annotated[int, msgspec.Meta(ge=1)] = 100
    messages_per_minute: Annotated[float, msgspec.Meta(ge=0)] = 0  # 0 = no limit
    connections_per_minute: Annotated[float, msgspec.Meta(ge=0)] = 0  # 0 = no limit
    burst: Annotated[int, msgspec.Meta(ge=1)] = 5  # token bucket size for both rates
    reserved_p0: Annotated[int, msgspec.Meta(ge=0)] = 1  # slots only the first class may use


class DestinationRule(Table):
    """Pacing for destinations matched by recipient domain or by MX host name suffix.

    A key left out keeps the value of shaping.default (see `policy/pacing_rules.pacing_for`)."""

    domain: str = ""  # e.g. "gmail.com"
    mx_suffix: str = ""  # e.g. ".google.com"
    max_connections: Annotated[int, msgspec.Meta(ge=1)] | None = None
    initial_connections: Annotated[int, msgspec.Meta(ge=1)] | None = None
    messages_per_connection: Annotated[int, msgspec.Meta(ge=1)] | None = None
    messages_per_minute: Annotated[float, msgspec.Meta(ge=0)] | None = None
    connections_per_minute: Annotated[float, msgspec.Meta(ge=0)] | None = None
    burst: Annotated[int, msgspec.Meta(ge=1)] | None = None
    reserved_p0: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def over(self, base: Pacing) -> Pacing:
        """`base` with this rule's keys applied."""
        given = {
            f: getattr(self, f) for f in Pacing.__struct_fields__ if getattr(self, f) is not None
        }
        return msgspec.structs.replace(base, **given)


class ThrottleRule(Table):
    """A reply pattern that, `threshold` times within `window`, puts a destination in backoff."""

    match: str  # regex searched in "CODE ENHANCED TEXT"
    threshold: Annotated[int, msgspec.Meta(ge=1)] = 1
    window: Duration = duration("1h")


class ShapingConfig(Table):
    group_by: Literal["mx", "domain"] = "mx"  # destination = the MX host set, or the domain
    default: Pacing = msgspec.field(default_factory=Pacing)
    destinations: list[DestinationRule] = []
    latency_factor: Annotated[float, msgspec.Meta(gt=1)] = 3.0  # silent throttling detection
    backoff_duration: Duration = duration("15m")
    backoff_rate_factor: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    backoff_retry_factor: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    backoff_successes: Annotated[int, msgspec.Meta(ge=1)] = 50  # a run that steps back a stage
    breaker_failures: Annotated[int, msgspec.Meta(ge=1)] = 5
    breaker_window: Duration = duration("1m")
    breaker_cooldown: Duration = duration("30s")
    breaker_cooldown_max: Duration = duration("30m")
    # A site that refuses our address (blocklist, reputation) is left alone this long at
    # least before one probe: knocking again while listed only deepens the listing.
    sender_block_pause: Duration = duration("30m")
    release_spread: Duration = duration("30s")  # waiting mail after a reopening, spread over this
    tenant_rate: str = ""  # per tenant over all destinations, e.g. "600/min"; "" = no cap
    throttle_rules: list[ThrottleRule] = []


class RetryConfig(Table):
    schedule: list[Duration] = msgspec.field(
        default_factory=lambda: [duration("5m"), duration("15m"), duration("30m"), duration("60m")]
    )
    then: list[Duration] = msgspec.field(default_factory=lambda: [duration("4h"), duration("6h")])
    greylist_min: Duration = duration("5m")
    jitter: Annotated[float, msgspec.Meta(ge=0, le=0.5)] = 0.1
    restart_spread: Duration = duration("1m")  # overdue mail after a restart is spread over this


class RelayConfig(Table):
    """A next hop of a class or a tenant: a smarthost, perhaps with client AUTH
    (routing/relays.py)."""

    relayhost: str = ""  # "" = as delivery.relayhost and routes say; syntax of split_host_port()
    relay_user: str = ""  # "" = no AUTH
    relay_password_file: str = ""  # the password: the file's first line
    # auto: implicit on port 465, else STARTTLS (required with relay_user, else delivery.tls)
    relay_tls: Literal["auto", "starttls", "implicit"] = "auto"
    # Required TLS verifies the smarthost's certificate and name: "" = against the system's
    # CA store, else against the CAs in this PEM file (a private CA, a self-signed relay).
    relay_tls_ca: str = ""
    # The [pools.NAME] whose source addresses its mail leaves from; "" = the default source
    # (unbound). A class's pool wins over its tenant's, as with relayhost.
    pool: str = ""


class ClassConfig(RelayConfig):
    lifetime: Duration = duration("5d")
    # notify: no DSN, an "expired" event the application compensates on
    expire_action: Literal["bounce", "discard", "hold", "notify"] = "bounce"
    priority: int = 1  # lower goes first
    weight: Annotated[int, msgspec.Meta(ge=1)] = 1
    # 0 = never; older mail is checked before an attempt
    revalidate_after: Duration = duration("0s")
    # A reply about our sending (our IP or domain listed, its reputation, SPF/DKIM/DMARC):
    # defer (keep trying until the lifetime ends), hold (for an operator, in review) or
    # bounce (a DSN now, no suppression: the recipient did nothing wrong).
    on_sender_block: Literal["defer", "hold", "bounce"] = "defer"


class TenantConfig(RelayConfig):
    """[tenants.NAME]: what is the tenant's own (its route and its source pool)."""


class SourceConfig(Table):
    """One source of a pool as a table: the address to bind, the name to say in EHLO."""

    address: str
    helo: str = ""  # "" = delivery.helo_name
    # A new address's warm-up: messages per destination per day, a step a day (day 1 the
    # first); past the list no limit. [] = warm already.
    warmup: list[int] = []


class PoolConfig(Table):
    """[pools.NAME]: source addresses that outgoing connections bind to (routing/pools.py)."""

    sources: list[str | SourceConfig] = []  # "ip" or {address = "ip", helo = "name"}
    # A source that draws a blocklist reply from a destination leaves for that long (for
    # that destination only; the pool's other sources carry on).
    blocklist_hold: Duration = duration("6h")
    # Mail that waits for the next UTC day's warm-up allowance comes back at a time drawn
    # for its destination within this much of that day's start, so that not every
    # destination starts at midnight (0s: at midnight).
    warmup_spread: Duration = duration("1h")


# Signed when present, From once more than present (so that none can be added); RFC 8058
# wants List-Unsubscribe and List-Unsubscribe-Post signed for one-click unsubscribing.
DKIM_HEADERS = (
    "from",
    "sender",
    "reply-to",
    "subject",
    "date",
    "message-id",
    "to",
    "cc",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
    "in-reply-to",
    "references",
    "list-id",
    "list-unsubscribe",
    "list-unsubscribe-post",
)


class DkimKeyConfig(Table):
    """A signing key of a [dkim."DOMAIN"] table (or of one entry of [[dkim."DOMAIN"]])."""

    selector: str
    key_file: str  # PEM private key: RSA (2048 bits is today's norm) or Ed25519
    algorithm: Literal["rsa-sha256", "ed25519-sha256"] = "rsa-sha256"
    headers: list[str] = []  # fields to sign, "from" among them; [] = DKIM_HEADERS


def dkim_path(domain: str, index: int | None = None) -> str:
    """How messages name a domain's DKIM key: dkim."example.com" (or ...[1] of several)."""
    return f'dkim."{domain}"' + ("" if index is None else f"[{index}]")


# Always defined; a [classes.NAME] table is merged over the class's defaults here.
DEFAULT_CLASSES = {
    "p0": ClassConfig(lifetime=duration("4h"), priority=0, weight=1),
    "p1": ClassConfig(lifetime=duration("5d"), priority=1, weight=4),
    "p2": ClassConfig(lifetime=duration("2d"), priority=2, weight=1),
}
