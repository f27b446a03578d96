"""`Config`, the root table of the configuration, and the tables of the daemon's own edges:
listen, submission, spool, control, metrics, alerts, log, dns, dsn, suppression, webhooks
(`WebhookConfig`, `EVENT_TYPES`), api and revalidate; `control_socket_path(cfg)`.

Every key has a default, so no file (or an empty one) is a valid configuration. The tables of
outbound delivery are in delivery_schema.py, the alert rules in alert_rules.py.
"""

import os
from typing import Annotated, Literal

import msgspec

from .alert_rules import AlertRule, MemoryGrowing, SenderBlocked
from .delivery_schema import (
    DEFAULT_CLASSES,
    ClassConfig,
    DeliveryConfig,
    DkimKeyConfig,
    MtaStsConfig,
    PoolConfig,
    RetryConfig,
    ShapingConfig,
    TenantConfig,
    TlsRptConfig,
)
from .table import Table
from .units import Duration, FreeSpace, Size, duration, size


class ListenConfig(Table):
    address: str = "127.0.0.1:2525"
    mynetworks: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    hostname: str = ""  # "" = the machine's FQDN, resolved by the daemon at start
    max_message_size: Size = size("25MiB")
    max_recipients: Annotated[int, msgspec.Meta(ge=1)] = 1000
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 200
    max_connections_per_client: Annotated[int, msgspec.Meta(ge=1)] = 50
    # Clients the per-client cap spares: CIDRs, "mynetworks" = every listen.mynetworks entry.
    client_limit_exceptions: list[str] = msgspec.field(default_factory=lambda: ["mynetworks"])
    command_timeout: Duration = duration("5m")  # deadline for one whole command line
    # ...under stress (80% of max_connections taken): Postfix's ${stress?{10}:{300}}s
    stress_command_timeout: Duration = duration("10s")
    data_timeout: Duration = duration("10m")  # DATA deadline, extended by what min_data_rate earns
    stress_data_timeout: Duration = duration("1m")  # ...under stress
    min_data_rate: Annotated[int, msgspec.Meta(ge=1)] = 500  # bytes/s, as Postfix's
    bare_newline: Literal["normalize", "reject"] = "normalize"
    max_line_length: Size = size("1MiB")  # longest line of message data (RFC 5322 says 998)
    tls_cert: str = ""
    tls_key: str = ""
    auth_file: str = ""  # "user:hash" lines; "" = AUTH not offered
    auth_required: bool = False  # true = clients in mynetworks must AUTH too


class SubmissionConfig(Table):
    default_class: str = "p1"
    dedupe_window: Duration = duration("24h")
    tenant_header: str = ""  # e.g. "X-Tenant": names the tenant when the client did not AUTH


class SpoolConfig(Table):
    path: str = "spool"
    min_free: FreeSpace = FreeSpace(fraction=0.02)
    journal_compact_size: Size = size("64MiB")
    stream_threshold: Size = size("256KiB")  # message data past this is written as it arrives
    file_after: Duration = duration("5s")  # a small message's file waits this long (0: none)
    shutdown_grace: Duration = duration("30s")


class ControlConfig(Table):
    socket: str = ""  # "" = <spool.path>/control.sock, see control_socket_path()
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o777)] = 0o600


class MetricsConfig(Table):
    address: str = ""  # "" = no metrics endpoint
    top_destinations: Annotated[int, msgspec.Meta(ge=1)] = 20  # the rest are "other"


class AlertsConfig(Table):
    interval: Duration = duration("30s")
    # A site refusing our address is never a thing to find out from a queue's depth.
    rules: list[AlertRule] = msgspec.field(
        default_factory=lambda: [SenderBlocked(), MemoryGrowing()]
    )


class LogConfig(Table):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "console"] = "json"


class DnsConfig(Table):
    nameservers: list[str] = []  # [] = the system resolver
    timeout: Duration = duration("5s")
    negative_ttl_max: Duration = duration("5m")


class DsnConfig(Table):
    delay_after: Duration = duration("4h")  # one delay notice per recipient after this long
    delay_without_notify: bool = False  # also when the sender gave no NOTIFY (RFC 3461 allows)
    max_return: Size = size("100KiB")  # content returned in a failure DSN; beyond: headers only
    klass: str = msgspec.field(default="p1", name="class")  # delivery class of DSNs
    lifetime: Duration = duration("2d")  # queue lifetime of DSNs themselves


class SuppressionConfig(Table):
    enabled: bool = True
    ttl: Duration = duration("30d")  # how long a hard-bounced address stays suppressed


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


class WebhookConfig(Table):
    """One [[webhooks]] entry: events POSTed as signed JSON to `url`."""

    url: str
    secret: str = ""  # HMAC-SHA256 key of X-Mtaqueue-Signature; or
    secret_file: str = ""  # the key as the file's first line
    name: str = ""  # "" = the url; names the endpoint's place in the event log
    events: list[str] = []  # [] = every type (EVENT_TYPES)
    classes: list[str] = []  # [] = every class
    tenants: list[str] = []  # [] = every tenant (and mail of none)
    timeout: Duration = duration("10s")
    batch_max: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 100
    max_age: Duration = duration("3d")  # an event not taken by then is dropped (logged, alerted)


class ApiConfig(Table):
    address: str = ""  # "" = no HTTP API; e.g. "127.0.0.1:8025"
    tokens_file: str = ""  # "TOKEN [TENANT]" lines


class RevalidateConfig(Table):
    url: str = ""  # "" = classes.NAME.revalidate_after is refused
    secret: str = ""
    secret_file: str = ""
    timeout: Duration = duration("5s")
    on_error: Literal["send", "hold"] = "send"


class Config(Table):
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
