"""`load(path, overrides)`: the Config from a TOML file and ``-o SECTION.KEY=VALUE`` (or
``-o SECTION=VALUE``: a whole section, arrays of tables included) overrides;
`default_path()`: the file when none is named (`SYSTEM_CONFIG`, or the environment's).

The file's raw tables are read, the overrides set over them, the tables converted ([classes.NAME]
over DEFAULT_CLASSES) and the result validated (validate.py). Problems raise ConfigError,
with the same messages for an override as for the file.
"""

import os
import re
import tomllib
from collections.abc import Sequence
from typing import Any

import msgspec

from .delivery_schema import (
    DEFAULT_CLASSES,
    ClassConfig,
    DkimKeyConfig,
    PoolConfig,
    TenantConfig,
    dkim_path,
)
from .errors import ConfigError
from .schema import Config
from .table import convert, kind
from .validate import validate


def _build(raw: dict[str, Any]) -> Config:
    """Convert the merged raw tables. classes and routes are converted entry by entry so that
    errors name the entry (msgspec reports dict values only as `[...]`)."""
    classes = raw.get("classes", {})
    if isinstance(classes, dict):
        merged = dict(DEFAULT_CLASSES)
        for name, table in classes.items():
            path = f"classes.{name}"
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: expected table, got {kind(table)}")
            if re.fullmatch(r"[A-Za-z0-9_-]+", name) is None:
                raise ConfigError(f"{path}: invalid class name (use letters, digits, _ and -)")
            base = msgspec.structs.asdict(merged[name]) if name in merged else {}
            merged[name] = convert(base | table, ClassConfig, path)
        raw["classes"] = merged
    tenants = raw.get("tenants", {})
    if isinstance(tenants, dict):
        raw["tenants"] = {n: convert(t, TenantConfig, f"tenants.{n}") for n, t in tenants.items()}
    pools = raw.get("pools", {})
    if isinstance(pools, dict):
        raw["pools"] = {n: convert(p, PoolConfig, f"pools.{n}") for n, p in pools.items()}
    routes = raw.get("routes", {})
    if isinstance(routes, dict):
        raw["routes"] = {d.lower(): convert(h, str, f"routes.{d}") for d, h in routes.items()}
    dkim = raw.get("dkim", {})
    if isinstance(dkim, dict):
        raw["dkim"] = {d: _dkim_keys(d, entry) for d, entry in dkim.items()}
    return convert(raw, Config)


def _dkim_keys(domain: str, entry: Any) -> list[DkimKeyConfig]:
    """A domain's keys from its table, or from its array of tables (several keys)."""
    if isinstance(entry, dict):
        return [convert(entry, DkimKeyConfig, dkim_path(domain))]
    if not isinstance(entry, list):
        raise ConfigError(f"{dkim_path(domain)}: expected table, got {kind(entry)}")
    return [convert(table, DkimKeyConfig, dkim_path(domain, i)) for i, table in enumerate(entry)]


def _override_value(text: str, item: str) -> Any:
    """A TOML value if `text` is one ("26", "true", '["1m"]', '[{url = "..."}]'), else the
    text itself ("[192.0.2.1]:25" is a relayhost, not a broken array). A table or an array
    of tables that does not parse is an error, as it would be in the file."""
    try:
        parsed = tomllib.loads("v = " + text)
    except tomllib.TOMLDecodeError as e:
        if text.startswith(("{", "[{")):
            raise ConfigError(f"override {item!r}: TOML syntax error: {e}") from None
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
    # One name alone sets a whole section: an array of tables (webhooks=[{...}]), a table
    # of tables (pools={...}), or an inline table in place of a [section]; an unknown one
    # gets the file's "unknown key".
    if not equals or "" in path:
        raise ConfigError(f"override {item!r}: expected SECTION.KEY=VALUE or SECTION=VALUE")
    table = raw
    for depth, name in enumerate(path[:-1], 1):
        table = table.setdefault(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{'.'.join(path[:depth])}: not a table, cannot set {key}")
    table[path[-1]] = _override_value(text.strip(), item)


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
    validate(cfg)
    return cfg
