"""Configuration: a TOML file plus ``-o SECTION.KEY=VALUE`` overrides, as frozen typed structs.

API: `load(path, overrides) -> Config`, `default_path()`, `ConfigError`; the tables callers
name, the units and the address parsers, re-exported from:
- `loading`: reading the file, applying overrides, building and validating the Config;
- `validate`: the checks that span keys;
- `schema`: `Config` and the tables of the daemon's own edges; `delivery_schema`: the tables
  of outbound delivery; `alert_rules`: the [[alerts.rules]] tables;
- `table`: the tables' base and the conversion of raw values, with messages naming the key;
- `units`: durations, sizes, free space, rates; `addresses`: host:port, nameservers, networks;
- `errors`: `ConfigError`.

Every key has a default, so no file (or an empty one) is a valid configuration. Problems raise
`ConfigError`, whose message is one line that starts with the key path, because the daemon and
the ctl print it as is and exit.
"""

from .addresses import parse_nameserver, split_host_port
from .delivery_schema import (
    DEFAULT_CLASSES,
    DKIM_HEADERS,
    ClassConfig,
    DeliveryConfig,
    DestinationRule,
    DkimKeyConfig,
    MtaStsConfig,
    Pacing,
    PoolConfig,
    RelayConfig,
    ReplyRule,
    RetryConfig,
    ShapingConfig,
    SourceConfig,
    ThrottleRule,
    TimeoutsConfig,
    dkim_path,
)
from .errors import ConfigError
from .loading import SYSTEM_CONFIG, default_path, load
from .schema import Config, SpoolConfig, WebhookConfig, control_socket_path
from .units import Duration, FreeSpace, Size, parse_duration, parse_rate, parse_size

__all__ = [
    "DEFAULT_CLASSES",
    "DKIM_HEADERS",
    "SYSTEM_CONFIG",
    "ClassConfig",
    "Config",
    "ConfigError",
    "DeliveryConfig",
    "DestinationRule",
    "DkimKeyConfig",
    "Duration",
    "FreeSpace",
    "MtaStsConfig",
    "Pacing",
    "PoolConfig",
    "RelayConfig",
    "ReplyRule",
    "RetryConfig",
    "ShapingConfig",
    "Size",
    "SourceConfig",
    "SpoolConfig",
    "ThrottleRule",
    "TimeoutsConfig",
    "WebhookConfig",
    "control_socket_path",
    "default_path",
    "dkim_path",
    "load",
    "parse_duration",
    "parse_nameserver",
    "parse_rate",
    "parse_size",
    "split_host_port",
]
