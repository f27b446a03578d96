"""Structured logging: one event per line, JSON (msgspec) or console text, level-filtered.

Loggers are cached on first use for speed, and a cached structlog logger keeps the level
and output it was built with. To let `configure_logging` change those at runtime (a
reload), `get_logger` remembers its loggers and each configure drops their cached copy.
"""

import sys
import weakref
from typing import Any, TextIO

import msgspec
import structlog
from structlog.typing import FilteringBoundLogger

_loggers: weakref.WeakSet[Any] = weakref.WeakSet()


def _json_renderer() -> structlog.processors.JSONRenderer:
    # JSONRenderer passes json.dumps-style keyword arguments (default=...) that msgspec does
    # not take; WriteLogger wants str. Unknown objects are logged as their str().
    encoder = msgspec.json.Encoder(enc_hook=str)
    return structlog.processors.JSONRenderer(
        serializer=lambda event, **_: encoder.encode(event).decode()
    )


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Log events at `level` ("debug", "info", "warning", "error") and above to `stream`
    (default: the current sys.stderr) as `fmt` ("json" or "console"). Callable again."""
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        # ConsoleRenderer formats exceptions itself; JSON needs them as a string field.
        processors += [structlog.processors.format_exc_info, _json_renderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    for logger in _loggers:
        # A lazy proxy caches by setting `bind` on itself; dropping it rebuilds on next use.
        vars(logger).pop("bind", None)


def get_logger(name: str) -> FilteringBoundLogger:
    """A logger whose events carry component=`name`; it follows later configure_logging calls."""
    logger = structlog.get_logger(component=name)
    _loggers.add(logger)
    return logger
