"""Configuration: a TOML file plus ``-o SECTION.KEY=VALUE`` overrides, as frozen typed structs.

Every key has a default, so no file (or an empty one) is a valid configuration. Problems raise
`ConfigError`, whose message is one line that starts with the key path, because the daemon and
the ctl print it as is and exit.
"""

import ipaddress
import itertools
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec


class ConfigError(Exception):
    """A config file or override that cannot be used; str() is one line naming the key."""


class Duration(float):
    """Seconds. TOML: "250ms", "90s", "15m", "4h", "5d", or a number of seconds."""


class Size(int):
    """Bytes. TOML: a number of bytes, or "512KiB", "25MiB", "1GiB", "10MB", "10kB"."""


class FreeSpace:
    """Space to keep free on a filesystem: a fixed number of bytes or a fraction of its size."""

    __slots__ = ("fraction", "nbytes")

    def __init__(self, nbytes: int = 0, fraction: float = 0.0) -> None:
        self.nbytes = nbytes
        self.fraction = fraction

    def bytes_for(self, total_bytes: int) -> int:
        """The bytes to keep free on a filesystem of `total_bytes`."""
        return self.nbytes + math.ceil(total_bytes * self.fraction)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FreeSpace):
            return NotImplemented
        return (self.nbytes, self.fraction) == (other.nbytes, other.fraction)

    def __hash__(self) -> int:
        return hash((self.nbytes, self.fraction))

    def __repr__(self) -> str:
        return f"FreeSpace(nbytes={self.nbytes}, fraction={self.fraction})"


_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_DURATION_RE = re.compile(_NUMBER + r"\s*(ms|s|m|h|d)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE_RE = re.compile(_NUMBER + r"\s*([A-Za-z]*)")
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
}


def parse_duration(text: str) -> float:
    """Seconds in "250ms", "90s", "15m", "4h", "5d" or "90" (seconds)."""
    m = _DURATION_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"invalid duration {text!r} (use e.g. 90s, 15m, 4h, 5d or seconds)")
    return float(m[1]) * _DURATION_UNITS[m[2] or "s"]


def parse_size(text: str) -> int:
    """Bytes in "512KiB", "25MiB", "1GiB", "10MB", "10kB" or "1000" (bytes)."""
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None or m[2] not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r} (use e.g. 512KiB, 25MiB, 1GiB, 10MB or bytes)")
    return int(float(m[1]) * _SIZE_UNITS[m[2]])


def parse_free_space(text: str) -> FreeSpace:
    """A `FreeSpace` from "5%" or a size ("2GiB")."""
    if text.strip().endswith("%"):
        number = text.strip()[:-1]
        if re.fullmatch(_NUMBER, number) is None or float(number) >= 100:
            raise ValueError(f"invalid percentage {text!r} (use e.g. 5%)")
        return FreeSpace(fraction=float(number) / 100)
    return FreeSpace(nbytes=parse_size(text))


def _kind(value: object) -> str:
    """A value's type in TOML words, for messages."""
    return {dict: "table", list: "array"}.get(type(value), type(value).__name__)


def _d(text: str) -> Duration:
    return Duration(parse_duration(text))


def _s(text: str) -> Size:
    return Size(parse_size(text))


# Unit type -> (numbers it takes as is, from a number, from text, what it is for messages).
_UNITS: dict[type, tuple[tuple[type, ...], Callable[[Any], Any], Callable[[str], Any], str]] = {
    Duration: ((int, float), Duration, _d, "a duration"),
    Size: ((int,), Size, _s, "a size"),
    FreeSpace: ((int,), lambda n: FreeSpace(nbytes=n), parse_free_space, "a size or percentage"),
}


def _dec_hook(type_: type, value: Any) -> Any:
    """Decode the unit types; a ValueError here becomes a ValidationError with the key path."""
    if type_ not in _UNITS:
        raise NotImplementedError
    numbers, from_number, from_text, what = _UNITS[type_]
    if isinstance(value, str):
        return from_text(value)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and isinstance(value, numbers) and 0 <= value < math.inf:
        return from_number(value)
    raise ValueError(f"expected {what}, got {repr(value) if is_number else _kind(value)}")


class _Table(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every table: immutable, and a misspelt key is refused rather than ignored."""


class ListenConfig(_Table):
    address: str = "127.0.0.1:2525"
    mynetworks: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    hostname: str = ""  # "" = the machine's FQDN, resolved by the daemon at start
    max_message_size: Size = _s("25MiB")
    max_recipients: Annotated[int, msgspec.Meta(ge=1)] = 1000
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 200
    max_connections_per_client: Annotated[int, msgspec.Meta(ge=1)] = 50
    # Clients the per-client cap spares: CIDRs, "mynetworks" = every listen.mynetworks entry.
    client_limit_exceptions: list[str] = msgspec.field(default_factory=lambda: ["mynetworks"])
    command_timeout: Duration = _d("5m")  # deadline for one whole command line
    data_timeout: Duration = _d("10m")  # DATA deadline, extended by what min_data_rate earns
    min_data_rate: Annotated[int, msgspec.Meta(ge=1)] = 500  # bytes/s, as Postfix's
    bare_newline: Literal["normalize", "reject"] = "normalize"
    max_line_length: Size = _s("1MiB")  # longest line of message data (RFC 5322 says 998)
    tls_cert: str = ""
    tls_key: str = ""
    auth_file: str = ""  # "user:hash" lines; "" = AUTH not offered
    auth_required: bool = False  # true = clients in mynetworks must AUTH too


class SubmissionConfig(_Table):
    default_class: str = "p1"
    dedupe_window: Duration = _d("24h")
    tenant_header: str = ""  # e.g. "X-Tenant": names the tenant when the client did not AUTH


class SpoolConfig(_Table):
    path: str = "spool"
    min_free: FreeSpace = FreeSpace(fraction=0.02)
    journal_compact_size: Size = _s("64MiB")
    stream_threshold: Size = _s("256KiB")  # message data past this is written as it arrives
    shutdown_grace: Duration = _d("30s")


class ControlConfig(_Table):
    socket: str = ""  # "" = <spool.path>/control.sock, see control_socket_path()
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o777)] = 0o600


class MetricsConfig(_Table):
    address: str = ""  # "" = no metrics endpoint
    top_destinations: Annotated[int, msgspec.Meta(ge=1)] = 20  # the rest are "other"


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


AlertRule = (
    OldestAge
    | DeferralRate
    | DepthGrowing
    | SpoolFree
    | ReviewSize
    | ReviewOldestAge
    | WebhookBacklog
)


class AlertsConfig(_Table):
    interval: Duration = _d("30s")
    rules: list[AlertRule] = []


class LogConfig(_Table):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "console"] = "json"


class DnsConfig(_Table):
    nameservers: list[str] = []  # [] = the system resolver
    timeout: Duration = _d("5s")
    negative_ttl_max: Duration = _d("5m")


class MtaStsConfig(_Table):
    """MTA-STS (RFC 8461) for delivery to recipient domains' MX hosts."""

    enabled: bool = True
    ca_file: str = ""  # CAs that policy hosts and enforced MX certificates chain to; "" = system
    fetch_timeout: Duration = _d("10s")  # the whole HTTPS GET of a policy
    https_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 443  # of policy hosts (tests)


class TlsRptConfig(_Table):
    """TLS-RPT (RFC 8460): daily reports of TLS results to the domains that ask for them."""

    enabled: bool = False  # reports go to the world: opt-in
    organization: str = ""  # organization-name; "" = listen.hostname
    contact: str = ""  # contact-info (an address or URL); "" = the `from` address
    sender: str = msgspec.field(default="", name="from")  # of mailto: reports; "" = postmaster@host


class TimeoutsConfig(_Table):
    """Per-phase SMTP client timeouts (RFC 5321 4.5.3.2 minimums, Postfix's connect)."""

    connect: Duration = _d("30s")
    banner: Duration = _d("5m")
    ehlo: Duration = _d("5m")
    starttls: Duration = _d("5m")
    mail: Duration = _d("5m")
    rcpt: Duration = _d("5m")
    data_start: Duration = _d("2m")
    data_done: Duration = _d("10m")  # sending the content and waiting for the final reply


class ReplyRule(_Table):
    """A site rule for replies, checked before the built-in classification."""

    match: str  # regex, searched in "CODE ENHANCED TEXT" (e.g. "421 4.7.0 Try again later")
    outcome: Literal["transient", "permanent"]
    kind: str = "policy"  # greylisting, throttling, mailbox, policy, content, ...
    phase: str = ""  # only replies in this phase ("" = any)


class DeliveryConfig(_Table):
    enabled: bool = True  # false: accept and queue only (mail waits, like a paused transport)
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 25
    relayhost: str = ""  # "" = MX lookup per domain; else a next hop, see split_host_port()
    helo_name: str = ""  # "" = listen.hostname
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 100
    max_recipients_per_transaction: Annotated[int, msgspec.Meta(ge=1)] = 100
    connection_idle: Duration = _d("5s")  # keep a connection this long for the next message
    max_addresses: Annotated[int, msgspec.Meta(ge=1)] = 5  # addresses tried per attempt
    address_order: Literal["ipv4-first", "ipv6-first", "as-resolved"] = "ipv4-first"
    tls: Literal["opportunistic", "required", "off"] = "opportunistic"
    ambiguous: Literal["retry", "assume-delivered"] = "retry"
    host_suspend: Duration = _d("1m")
    host_suspend_max: Duration = _d("1h")
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    rules: list[ReplyRule] = []
    max_rate: str = ""  # over all destinations, e.g. "100/min"; "" = no cap


class Pacing(_Table):
    """Limits of one destination; each key of a [[shaping.destinations]] entry overrides one."""

    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 10
    initial_connections: Annotated[int, msgspec.Meta(ge=1)] = 2  # adaptive: start here
    messages_per_connection: Annotated[int, msgspec.Meta(ge=1)] = 100
    messages_per_minute: Annotated[float, msgspec.Meta(ge=0)] = 0  # 0 = no limit
    connections_per_minute: Annotated[float, msgspec.Meta(ge=0)] = 0  # 0 = no limit
    burst: Annotated[int, msgspec.Meta(ge=1)] = 5  # token bucket size for both rates
    reserved_p0: Annotated[int, msgspec.Meta(ge=0)] = 1  # slots only the first class may use


class DestinationRule(_Table):
    """Pacing for destinations matched by recipient domain or by MX host name suffix.

    A key left out keeps the value of shaping.default (see `pacing_for`)."""

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


class ThrottleRule(_Table):
    """A reply pattern that, `threshold` times within `window`, puts a destination in backoff."""

    match: str  # regex searched in "CODE ENHANCED TEXT"
    threshold: Annotated[int, msgspec.Meta(ge=1)] = 1
    window: Duration = _d("1h")


class ShapingConfig(_Table):
    group_by: Literal["mx", "domain"] = "mx"  # destination = the MX host set, or the domain
    default: Pacing = msgspec.field(default_factory=Pacing)
    destinations: list[DestinationRule] = []
    latency_factor: Annotated[float, msgspec.Meta(gt=1)] = 3.0  # silent throttling detection
    backoff_duration: Duration = _d("15m")
    backoff_rate_factor: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    backoff_retry_factor: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    backoff_successes: Annotated[int, msgspec.Meta(ge=1)] = 50  # a run that steps back a stage
    breaker_failures: Annotated[int, msgspec.Meta(ge=1)] = 5
    breaker_window: Duration = _d("1m")
    breaker_cooldown: Duration = _d("30s")
    breaker_cooldown_max: Duration = _d("30m")
    release_spread: Duration = _d("30s")  # waiting mail after a reopening, spread over this
    tenant_rate: str = ""  # per tenant over all destinations, e.g. "600/min"; "" = no cap
    throttle_rules: list[ThrottleRule] = []


class DsnConfig(_Table):
    delay_after: Duration = _d("4h")  # one delay notice per recipient after this long
    delay_without_notify: bool = False  # also when the sender gave no NOTIFY (RFC 3461 allows)
    max_return: Size = _s("100KiB")  # content returned in a failure DSN; beyond: headers only
    klass: str = msgspec.field(default="p1", name="class")  # delivery class of DSNs
    lifetime: Duration = _d("2d")  # queue lifetime of DSNs themselves


class SuppressionConfig(_Table):
    enabled: bool = True
    ttl: Duration = _d("30d")  # how long a hard-bounced address stays suppressed


class RetryConfig(_Table):
    schedule: list[Duration] = msgspec.field(
        default_factory=lambda: [_d("5m"), _d("15m"), _d("30m"), _d("60m")]
    )
    then: list[Duration] = msgspec.field(default_factory=lambda: [_d("4h"), _d("6h")])
    greylist_min: Duration = _d("5m")
    jitter: Annotated[float, msgspec.Meta(ge=0, le=0.5)] = 0.1
    restart_spread: Duration = _d("1m")  # overdue mail after a restart is spread over this


class RelayConfig(_Table):
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
    lifetime: Duration = _d("5d")
    # notify: no DSN, an "expired" event the application compensates on
    expire_action: Literal["bounce", "discard", "hold", "notify"] = "bounce"
    priority: int = 1  # lower goes first
    weight: Annotated[int, msgspec.Meta(ge=1)] = 1
    revalidate_after: Duration = _d("0s")  # 0 = never; older mail is checked before an attempt


class TenantConfig(RelayConfig):
    """[tenants.NAME]: what is the tenant's own (its route and its source pool)."""


class SourceConfig(_Table):
    """One source of a pool as a table: the address to bind, the name to say in EHLO."""

    address: str
    helo: str = ""  # "" = delivery.helo_name
    # A new address's warm-up: messages per destination per day, a step a day (day 1 the
    # first); past the list no limit. [] = warm already.
    warmup: list[int] = []


class PoolConfig(_Table):
    """[pools.NAME]: source addresses that outgoing connections bind to (routing/pools.py)."""

    sources: list[str | SourceConfig] = []  # "ip" or {address = "ip", helo = "name"}
    # A source that draws a blocklist reply from a destination leaves for that long (for
    # that destination only; the pool's other sources carry on).
    blocklist_hold: Duration = _d("6h")
    # Mail that waits for the next UTC day's warm-up allowance comes back at a time drawn
    # for its destination within this much of that day's start, so that not every
    # destination starts at midnight (0s: at midnight).
    warmup_spread: Duration = _d("1h")


EVENT_TYPES = (
    "accepted",
    "delivered",
    "deferred",
    "delayed",
    "bounced",
    "expired",
    "suppressed",
    "cancelled",
    "held",
)


class WebhookConfig(_Table):
    """One [[webhooks]] entry: events POSTed as signed JSON to `url`."""

    url: str
    secret: str = ""  # HMAC-SHA256 key of X-Mtaqueue-Signature; or
    secret_file: str = ""  # the key as the file's first line
    name: str = ""  # "" = the url; names the endpoint's place in the event log
    events: list[str] = []  # [] = every type (EVENT_TYPES)
    classes: list[str] = []  # [] = every class
    tenants: list[str] = []  # [] = every tenant (and mail of none)
    timeout: Duration = _d("10s")
    batch_max: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 100
    max_age: Duration = _d("3d")  # an event not taken by then is dropped (logged, alerted)


class ApiConfig(_Table):
    address: str = ""  # "" = no HTTP API; e.g. "127.0.0.1:8025"
    tokens_file: str = ""  # "TOKEN [TENANT]" lines


class RevalidateConfig(_Table):
    url: str = ""  # "" = classes.NAME.revalidate_after is refused
    secret: str = ""
    secret_file: str = ""
    timeout: Duration = _d("5s")
    on_error: Literal["send", "hold"] = "send"


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


class DkimKeyConfig(_Table):
    """A signing key of a [dkim."DOMAIN"] table (or of one entry of [[dkim."DOMAIN"]])."""

    selector: str
    key_file: str  # PEM private key: RSA (2048 bits is today's norm) or Ed25519
    algorithm: Literal["rsa-sha256", "ed25519-sha256"] = "rsa-sha256"
    headers: list[str] = []  # fields to sign, "from" among them; [] = DKIM_HEADERS


# Always defined; a [classes.NAME] table is merged over the class's defaults here.
DEFAULT_CLASSES = {
    "p0": ClassConfig(lifetime=_d("4h"), priority=0, weight=1),
    "p1": ClassConfig(lifetime=_d("5d"), priority=1, weight=4),
    "p2": ClassConfig(lifetime=_d("2d"), priority=2, weight=1),
}


class Config(_Table):
    listen: ListenConfig = msgspec.field(default_factory=ListenConfig)
    submission: SubmissionConfig = msgspec.field(default_factory=SubmissionConfig)
    spool: SpoolConfig = msgspec.field(default_factory=SpoolConfig)
    control: ControlConfig = msgspec.field(default_factory=ControlConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    alerts: AlertsConfig = msgspec.field(default_factory=AlertsConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    dns: DnsConfig = msgspec.field(default_factory=DnsConfig)
    mta_sts: MtaStsConfig = msgspec.field(default_factory=MtaStsConfig)
    tls_rpt: TlsRptConfig = msgspec.field(default_factory=TlsRptConfig)
    delivery: DeliveryConfig = msgspec.field(default_factory=DeliveryConfig)
    routes: dict[str, str] = {}  # lower-cased domain -> next hop
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    shaping: ShapingConfig = msgspec.field(default_factory=ShapingConfig)
    dsn: DsnConfig = msgspec.field(default_factory=DsnConfig)
    suppression: SuppressionConfig = msgspec.field(default_factory=SuppressionConfig)
    classes: dict[str, ClassConfig] = msgspec.field(default_factory=lambda: dict(DEFAULT_CLASSES))
    tenants: dict[str, TenantConfig] = {}
    pools: dict[str, PoolConfig] = {}
    webhooks: list[WebhookConfig] = []
    api: ApiConfig = msgspec.field(default_factory=ApiConfig)
    # domain (as written) -> its keys: [dkim."example.com"], or [[dkim."example.com"]] twice
    dkim: dict[str, list[DkimKeyConfig]] = {}
    revalidate: RevalidateConfig = msgspec.field(default_factory=RevalidateConfig)


def control_socket_path(cfg: Config) -> str:
    """The control socket's path: control.socket, or control.sock in the spool."""
    return cfg.control.socket or os.path.join(cfg.spool.path, "control.sock")


_PORT_RE = re.compile(r"[0-9]{1,5}")
_LABEL_RE = re.compile(r"[A-Za-z0-9_-]{1,63}")


def _valid_host(host: str) -> bool:
    if ":" in host:
        try:
            return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
        except ValueError:
            return False
    labels = host.removesuffix(".").split(".")
    return len(host) <= 253 and all(_LABEL_RE.fullmatch(label) for label in labels)


def split_host_port(
    text: str, default_port: int | None = None, *, min_port: int = 1
) -> tuple[str, int]:
    """Split "host:port" or "[host]:port" (IPv6, or a Postfix-style next hop without MX
    lookup); with a default_port the port may be left out. The host comes back unbracketed:
    callers that care whether it was bracketed check ``text.startswith("[")``."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"invalid address {text!r} (expected [host]:port)")
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    elif ":" in text:
        raise ValueError(f"invalid address {text!r} (put an IPv6 address in brackets: [::1]:25)")
    else:
        host, port = text, None
    if not _valid_host(host):
        raise ValueError(f"invalid host in {text!r}")
    if port is None:
        if default_port is None:
            raise ValueError(f"missing port in {text!r} (expected host:port)")
        return host, default_port
    if _PORT_RE.fullmatch(port) is None or not min_port <= int(port) <= 65535:
        raise ValueError(f"invalid port in {text!r}")
    return host, int(port)


_RATE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|m|min|h|hour|d|day)\s*")
_RATE_UNITS = {
    "s": 1,
    "sec": 1,
    "m": 60,
    "min": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}


def parse_rate(text: str) -> float:
    """Events per second from "100/min", "5/s", "2000/h"."""
    match = _RATE_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"invalid rate {text!r} (use e.g. 100/min, 5/s, 2000/h)")
    return float(match[1]) / _RATE_UNITS[match[2]]


def parse_nameserver(text: str) -> tuple[str, int]:
    """(ip, port) from "ip", "ip:port" or "[ipv6]:port"; the port defaults to 53."""
    try:
        return str(ipaddress.ip_address(text)), 53
    except ValueError:
        pass
    try:
        host, port = split_host_port(text, default_port=53)
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        raise ValueError(f"invalid nameserver {text!r} (expected ip or ip:port)") from None


def _check_network(text: str) -> None:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(f"invalid network {text!r} (expected CIDR, e.g. 10.0.0.0/8)") from None


_VALIDATION_RE = re.compile(r"(.*) - at `\$(.*)`", re.DOTALL)


def _explain(message: str, type_: Any, prefix: str) -> str:
    """Rewrite a msgspec message ("Expected `int`, got `str` - at `$.delivery.port`") as
    "delivery.port: expected int, got str"."""
    m = _VALIDATION_RE.fullmatch(message)
    problem, where = (m[1], m[2]) if m else (message, "")
    path = prefix + where
    if unknown := re.fullmatch(r"Object contains unknown field `(.*)`", problem):
        path, problem = f"{path}.{unknown[1]}", "unknown key"
    elif missing := re.fullmatch(r"Object missing required field `(.*)`", problem):
        path, problem = f"{path}.{missing[1]}", "required"
    elif enum := re.fullmatch(r"Invalid enum value (.*)", problem):
        for name in where.split(".")[1:]:
            type_ = {f.name: f.type for f in msgspec.structs.fields(type_)}[name]
        problem = f"invalid value {enum[1]} (expected one of {', '.join(typing.get_args(type_))})"
    else:
        problem = problem.replace("`object`", "table").replace("`", "")
        problem = problem[:1].lower() + problem[1:]
    return f"{path.lstrip('.')}: {problem}"


def _convert(value: Any, type_: Any, prefix: str = "") -> Any:
    try:
        return msgspec.convert(value, type_, dec_hook=_dec_hook)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(str(e), type_, prefix)) from None


def _build(raw: dict[str, Any]) -> Config:
    """Convert the merged raw tables. classes and routes are converted entry by entry so that
    errors name the entry (msgspec reports dict values only as `[...]`)."""
    classes = raw.get("classes", {})
    if isinstance(classes, dict):
        merged = dict(DEFAULT_CLASSES)
        for name, table in classes.items():
            path = f"classes.{name}"
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: expected table, got {_kind(table)}")
            if re.fullmatch(r"[A-Za-z0-9_-]+", name) is None:
                raise ConfigError(f"{path}: invalid class name (use letters, digits, _ and -)")
            base = msgspec.structs.asdict(merged[name]) if name in merged else {}
            merged[name] = _convert(base | table, ClassConfig, path)
        raw["classes"] = merged
    tenants = raw.get("tenants", {})
    if isinstance(tenants, dict):
        raw["tenants"] = {n: _convert(t, TenantConfig, f"tenants.{n}") for n, t in tenants.items()}
    pools = raw.get("pools", {})
    if isinstance(pools, dict):
        raw["pools"] = {n: _convert(p, PoolConfig, f"pools.{n}") for n, p in pools.items()}
    routes = raw.get("routes", {})
    if isinstance(routes, dict):
        raw["routes"] = {d.lower(): _convert(h, str, f"routes.{d}") for d, h in routes.items()}
    dkim = raw.get("dkim", {})
    if isinstance(dkim, dict):
        raw["dkim"] = {d: _dkim_keys(d, entry) for d, entry in dkim.items()}
    return _convert(raw, Config)


def _dkim_keys(domain: str, entry: Any) -> list[DkimKeyConfig]:
    """A domain's keys from its table, or from its array of tables (several keys)."""
    if isinstance(entry, dict):
        return [_convert(entry, DkimKeyConfig, dkim_path(domain))]
    if not isinstance(entry, list):
        raise ConfigError(f"{dkim_path(domain)}: expected table, got {_kind(entry)}")
    return [_convert(table, DkimKeyConfig, dkim_path(domain, i)) for i, table in enumerate(entry)]


def dkim_path(domain: str, index: int | None = None) -> str:
    """How messages name a domain's DKIM key: dkim."example.com" (or ...[1] of several)."""
    return f'dkim."{domain}"' + ("" if index is None else f"[{index}]")


def _check(path: str, check: Callable[..., object], *args: Any) -> None:
    try:
        check(*args)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def _validate(cfg: Config) -> None:
    """Checks that span keys or need more than a type."""
    listen, retry = cfg.listen, cfg.retry
    # Port 0 binds an ephemeral port (tests); the "ready" log event names it.
    _check("listen.address", lambda a: split_host_port(a, min_port=0), listen.address)
    for i, network in enumerate(listen.mynetworks):
        _check(f"listen.mynetworks[{i}]", _check_network, network)
    for i, network in enumerate(listen.client_limit_exceptions):
        if network != "mynetworks":
            _check(f"listen.client_limit_exceptions[{i}]", _check_network, network)
    if bool(listen.tls_cert) != bool(listen.tls_key):
        missing, given = ("tls_key", "tls_cert") if listen.tls_cert else ("tls_cert", "tls_key")
        raise ConfigError(f"listen.{missing}: required when listen.{given} is set")
    if listen.max_line_length < 998:
        raise ConfigError("listen.max_line_length: must be at least 998 (RFC 5322 2.1.1)")
    if listen.auth_required and not listen.auth_file:
        raise ConfigError("listen.auth_required: needs listen.auth_file")
    positive = {
        "listen.command_timeout": listen.command_timeout,
        "listen.data_timeout": listen.data_timeout,
        "dns.timeout": cfg.dns.timeout,
        "mta_sts.fetch_timeout": cfg.mta_sts.fetch_timeout,
        "alerts.interval": cfg.alerts.interval,
    } | {f"classes.{name}.lifetime": c.lifetime for name, c in cfg.classes.items()}
    for path, seconds in positive.items():
        if seconds <= 0:
            raise ConfigError(f"{path}: must be more than 0s")
    if cfg.submission.default_class not in cfg.classes:
        defined = ", ".join(cfg.classes)
        raise ConfigError(
            f"submission.default_class: unknown class {cfg.submission.default_class!r}"
            f" (defined: {defined})"
        )
    if not cfg.spool.path:
        raise ConfigError("spool.path: must not be empty")
    if cfg.metrics.address:
        _check("metrics.address", lambda a: split_host_port(a, min_port=0), cfg.metrics.address)
    for i, server in enumerate(cfg.dns.nameservers):
        _check(f"dns.nameservers[{i}]", parse_nameserver, server)
    if cfg.delivery.relayhost:
        _check("delivery.relayhost", split_host_port, cfg.delivery.relayhost, cfg.delivery.port)
    for domain, hop in cfg.routes.items():
        if not _valid_host(domain) or ":" in domain:
            raise ConfigError(f"routes.{domain}: invalid domain")
        # "" routes the domain by its MX records, bypassing delivery.relayhost.
        if hop:
            _check(f"routes.{domain}", split_host_port, hop, cfg.delivery.port)
    for i, rule in enumerate(cfg.delivery.rules):
        try:
            re.compile(rule.match)
        except re.error as exc:
            raise ConfigError(f"delivery.rules[{i}].match: invalid regex: {exc}") from None
    if cfg.delivery.max_rate:
        _check("delivery.max_rate", parse_rate, cfg.delivery.max_rate)
    if cfg.shaping.tenant_rate:
        _check("shaping.tenant_rate", parse_rate, cfg.shaping.tenant_rate)
    for i, rule in enumerate(cfg.shaping.destinations):
        if bool(rule.domain) == bool(rule.mx_suffix):
            raise ConfigError(f"shaping.destinations[{i}]: give exactly one of domain, mx_suffix")
    for i, rule in enumerate(cfg.shaping.throttle_rules):
        try:
            re.compile(rule.match)
        except re.error as exc:
            raise ConfigError(f"shaping.throttle_rules[{i}].match: invalid regex: {exc}") from None
    if cfg.dsn.klass not in cfg.classes:
        raise ConfigError(f"dsn.class: unknown class {cfg.dsn.klass!r}")
    relays = {f"classes.{n}": c for n, c in cfg.classes.items()}
    relays |= {f"tenants.{n}": t for n, t in cfg.tenants.items()}
    for path, relay in relays.items():
        _validate_relay(path, relay, cfg.delivery.port)
        if relay.pool and relay.pool not in cfg.pools:
            raise ConfigError(f"{path}.pool: unknown pool {relay.pool!r}")
    for name, pool in cfg.pools.items():
        _validate_pool(f"pools.{name}", pool)
    for name, klass in cfg.classes.items():
        if klass.revalidate_after < 0:
            raise ConfigError(f"classes.{name}.revalidate_after: must not be negative")
        if klass.revalidate_after and not cfg.revalidate.url:
            raise ConfigError(f"classes.{name}.revalidate_after: needs revalidate.url")
    if cfg.revalidate.url:
        _check("revalidate.url", _check_url, cfg.revalidate.url)
    _validate_webhooks(cfg)
    _validate_dkim(cfg)
    if cfg.api.address:
        _check("api.address", lambda a: split_host_port(a, min_port=0), cfg.api.address)
    if len(retry.then) != 2:
        raise ConfigError(f"retry.then: expected two durations [min, max], got {len(retry.then)}")
    if retry.then[0] > retry.then[1]:
        raise ConfigError("retry.then: min is greater than max")


def _validate_pool(path: str, pool: PoolConfig) -> None:
    if not pool.sources:
        raise ConfigError(f"{path}.sources: name at least one address")
    seen: set[str] = set()
    for i, source in enumerate(pool.sources):
        address = source if isinstance(source, str) else source.address
        try:
            address = str(ipaddress.ip_address(address))
        except ValueError:
            raise ConfigError(f"{path}.sources[{i}]: not an IP address: {address!r}") from None
        if address in seen:
            raise ConfigError(f"{path}.sources[{i}]: {address} is named twice")
        seen.add(address)
        steps = [] if isinstance(source, str) else source.warmup
        if any(n <= 0 for n in steps) or any(a >= b for a, b in itertools.pairwise(steps)):
            raise ConfigError(f"{path}.sources[{i}].warmup: use increasing numbers above 0")
    if pool.blocklist_hold <= 0:
        raise ConfigError(f"{path}.blocklist_hold: must be more than 0s")
    if not 0 <= pool.warmup_spread <= 86400:
        raise ConfigError(f"{path}.warmup_spread: must be from 0s to 1d")


def _check_url(url: str) -> None:
    if re.fullmatch(r"https?://[^/\s]+(/\S*)?", url) is None:
        raise ValueError(f"invalid URL {url!r} (expected http://host[:port]/path or https://...)")


def _validate_relay(path: str, relay: RelayConfig, default_port: int) -> None:
    if relay.relayhost:
        _check(f"{path}.relayhost", split_host_port, relay.relayhost, default_port)
    for key in ("relay_user", "relay_tls_ca"):
        if getattr(relay, key) and not relay.relayhost:
            raise ConfigError(f"{path}.{key}: needs {path}.relayhost")
    if bool(relay.relay_user) != bool(relay.relay_password_file):
        missing = "relay_password_file" if relay.relay_user else "relay_user"
        raise ConfigError(f"{path}.{missing}: required with the other AUTH key")


def _validate_webhooks(cfg: Config) -> None:
    names: set[str] = set()
    for i, hook in enumerate(cfg.webhooks):
        path = f"webhooks[{i}]"
        _check(f"{path}.url", _check_url, hook.url)
        if not hook.secret and not hook.secret_file:
            raise ConfigError(f"{path}.secret: required (or secret_file): events are signed")
        for kind in hook.events:
            if kind not in EVENT_TYPES:
                known = ", ".join(EVENT_TYPES)
                raise ConfigError(f"{path}.events: unknown event type {kind!r} (known: {known})")
        for klass in hook.classes:
            if klass not in cfg.classes:
                raise ConfigError(f"{path}.classes: unknown class {klass!r}")
        name = hook.name or hook.url
        if name in names:
            raise ConfigError(f"{path}.name: {name!r} names another webhook too")
        names.add(name)
        if hook.timeout <= 0 or hook.max_age <= 0:
            raise ConfigError(f"{path}: timeout and max_age must be more than 0s")


_SELECTOR_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_FIELD_NAME_RE = re.compile(r"[!-9;-~]+")  # RFC 5322 ftext


def _validate_dkim(cfg: Config) -> None:
    """What can be checked without the key files (the daemon reads those: dkim/keys.py)."""
    domains: set[str] = set()
    for domain, keys in cfg.dkim.items():
        if not _valid_host(domain) or ":" in domain or "." not in domain.strip("."):
            raise ConfigError(f"{dkim_path(domain)}: invalid domain")
        if domain.lower().rstrip(".") in domains:
            raise ConfigError(f"{dkim_path(domain)}: the domain has another [dkim] table too")
        domains.add(domain.lower().rstrip("."))
        selectors = set()
        for i, key in enumerate(keys):
            path = dkim_path(domain, i if len(keys) > 1 else None)
            if not all(_SELECTOR_RE.fullmatch(label) for label in key.selector.split(".")):
                raise ConfigError(f"{path}.selector: invalid selector {key.selector!r}")
            if key.selector.lower() in selectors:
                raise ConfigError(f"{path}.selector: {key.selector!r} names another key too")
            selectors.add(key.selector.lower())
            if not key.key_file:
                raise ConfigError(f"{path}.key_file: must not be empty")
            for name in key.headers:
                if _FIELD_NAME_RE.fullmatch(name) is None:
                    raise ConfigError(f"{path}.headers: {name!r} is not a header field name")
            if key.headers and "from" not in (name.lower() for name in key.headers):
                raise ConfigError(f"{path}.headers: must include From (RFC 6376 5.4)")


def _override_value(text: str) -> Any:
    """A TOML value if `text` is one ("26", "true", '["1m"]'), else the text itself."""
    try:
        parsed = tomllib.loads("v = " + text)
    except tomllib.TOMLDecodeError:
        return text
    return parsed["v"] if parsed.keys() == {"v"} else text


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, equals, text = item.partition("=")
    key = key.strip()
    # A route's key is a domain, dots included; so is a DKIM table's.
    if key.startswith("routes."):
        path = ["routes", key[7:]]
    elif key.startswith("dkim."):  # dkim.DOMAIN.selector=..., or dkim.DOMAIN=[{...}, ...]
        domain, _, name = key[5:].rpartition(".")
        if name in DkimKeyConfig.__struct_fields__:
            path = ["dkim", domain.strip('"'), name]
        else:
            path = ["dkim", key[5:].strip('"')]
    else:
        path = key.split(".")
    if not equals or len(path) < 2 or "" in path:
        raise ConfigError(f"override {item!r}: expected SECTION.KEY=VALUE")
    table = raw
    for depth, name in enumerate(path[:-1], 1):
        table = table.setdefault(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{'.'.join(path[:depth])}: not a table, cannot set {key}")
    table[path[-1]] = _override_value(text.strip())


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        # tomllib says "Invalid value (at line 3, column 7)"; lead with the position.
        m = re.fullmatch(r"(.*) \((at .*)\)", str(e))
        detail = f"{m[2]}: {m[1][:1].lower()}{m[1][1:]}" if m else str(e)
        raise ConfigError(f"config file {path}: TOML syntax error {detail}") from None


SYSTEM_CONFIG = "/etc/mtaqueue/mtaqueue.toml"


def default_path() -> str | None:
    """The config file when none is named (-c): $MTAQUEUE_CONFIG, else SYSTEM_CONFIG if it
    exists, else None: the built-in defaults. The daemon and mtaqueue-ctl both ask here, so
    that they agree on the control socket."""
    if env := os.environ.get("MTAQUEUE_CONFIG"):
        return env
    return SYSTEM_CONFIG if os.path.exists(SYSTEM_CONFIG) else None


def load(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """The configuration from the TOML file at `path` (None = defaults only), with each
    "SECTION.KEY=VALUE" override applied over it. Raises ConfigError."""
    raw = _read(path) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(raw)
    _validate(cfg)
    return cfg
