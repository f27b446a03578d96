"""Units of config values: `Duration` (seconds), `Size` (bytes) and `FreeSpace`; their
parsers `parse_duration`, `parse_size`, `parse_free_space`, and `parse_rate` ("100/min");
`duration("5m")` and `size("25MiB")` for defaults written as text.

A parser raises ValueError saying what it expected; the caller names the key or the option.
"""

import math
import re


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


def duration(text: str) -> Duration:
    return Duration(parse_duration(text))


def size(text: str) -> Size:
    return Size(parse_size(text))


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
