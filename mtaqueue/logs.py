"""Structured logging: one event per line, JSON (msgspec) or console text, level-filtered.

    configure_logging(level="info", fmt="json", stream=None)   # callable again (reload)
    log = get_logger("delivery")
    log.info("delivery", id=..., code=250)      # also debug, warning, error, critical
    log.exception("settle_failed", id=...)      # error, with the traceback as `exception`

A JSON line holds `component`, the event's fields, `event`, `level` and `timestamp` (ISO 8601,
UTC, microseconds). Each line is one write to the stream's file descriptor, so lines from
threads do not interleave and a crash loses none that was logged.

This is not structlog: the daemon logs twice a message at its shipped level, and structlog's
general chain (context merge, processors, a flushed text stream) cost ~17 µs a call — several
per cent of the daemon's thread at full speed. Loggers read the module's settings at each call,
so a reload's level and format apply to loggers made before it.
"""

import os
import sys
import time
import traceback
from typing import Any, TextIO

import msgspec

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


class _Output:
    """Where lines go and how they are made; replaced whole by configure_logging."""

    def __init__(self, level: str, fmt: str, stream: TextIO | None) -> None:
        if level not in _LEVELS:
            raise ValueError(f"unknown log level {level!r} (one of {', '.join(_LEVELS)})")
        self.threshold = _LEVELS[level]
        self.json = fmt == "json"
        self.stream = stream  # None: the process's stderr at the time of each write
        self.encoder = msgspec.json.Encoder(enc_hook=str)  # unknown objects: their str()

    def emit(self, component: str, level: str, event: str, fields: dict[str, Any]) -> None:
        stamp = _timestamp()
        if self.json:
            record = {"component": component, **fields}
            record.update(event=event, level=level, timestamp=stamp)
            self._write(self.encoder.encode(record) + b"\n")
        else:
            self._write(_console_line(stamp, level, component, event, fields).encode())

    def _write(self, line: bytes) -> None:
        stream = self.stream or sys.stderr
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            stream.write(line.decode())  # an in-memory stream (tests)
            stream.flush()
            return
        while line:  # a write may be short (a pipe near full)
            line = line[os.write(fd, line) :]


_output = _Output("info", "json", None)
_second = (0, "")  # the last whole second formatted, for _timestamp


def _timestamp() -> str:
    """Now in ISO 8601 UTC with microseconds; the seconds part is formatted once a second."""
    global _second
    now = time.time()
    whole = int(now)
    if whole != _second[0]:
        _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return f"{_second[1]}.{int((now - whole) * 1e6):06d}Z"


def _console_line(stamp: str, level: str, component: str, event: str, fields: dict) -> str:
    text = fields.pop("exception", None)
    pairs = " ".join(f"{key}={value!r}" for key, value in fields.items())
    line = f"{stamp} [{level:<8}] {event:<28} component={component!r} {pairs}".rstrip()
    return line + "\n" + (text + "\n" if text else "")


class Logger:
    """Events of one component; each level's call is a no-op below the configured level."""

    __slots__ = ("component",)

    def __init__(self, component: str) -> None:
        self.component = component

    def debug(self, event: str, **fields: Any) -> None:
        if _output.threshold <= 10:
            _output.emit(self.component, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        if _output.threshold <= 20:
            _output.emit(self.component, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        if _output.threshold <= 30:
            _output.emit(self.component, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        if _output.threshold <= 40:
            _output.emit(self.component, "error", event, fields)

    def critical(self, event: str, **fields: Any) -> None:
        _output.emit(self.component, "critical", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error event with the exception being handled, formatted, as `exception`."""
        if _output.threshold <= 40:
            fields["exception"] = traceback.format_exc().rstrip("\n")
            _output.emit(self.component, "error", event, fields)


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Log events at `level` ("debug", "info", "warning", "error") and above to `stream`
    (default: the process's stderr) as `fmt` ("json" or "console"). Callable again."""
    global _output
    _output = _Output(level, fmt, stream)


def get_logger(name: str) -> Logger:
    """A logger whose events carry component=`name`; it follows later configure_logging calls."""
    return Logger(name)
