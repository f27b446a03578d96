"""Wire protocol of the control socket: JSON lines over a Unix stream socket.

The client sends one request line, ``{"cmd": "list", "args": {...}}``. The server
answers with zero or more data lines, each one JSON object, then a final line
``{"ok": true}`` or ``{"ok": false, "error": "one line"}``, and closes. A reply line
is final when it has an ``"ok"`` key, so data objects never carry one. Streaming
lets ``list`` send 100k messages without building one huge string.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import msgspec

MAX_REQUEST = 1024 * 1024  # bytes in one request line, newline included
REPLY_TIMEOUT = 30.0  # seconds the client waits for each reply line


class ProtocolError(Exception):
    """A line that does not follow the protocol, or an exchange that broke off."""


class RemoteError(Exception):
    """The server's final line said ``ok: false``; the message is its error text."""


class Request(msgspec.Struct, forbid_unknown_fields=True):
    cmd: str
    args: dict[str, Any] = {}


_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(Request)
_reply_decoder = msgspec.json.Decoder(dict[str, Any])


def encode(obj: Any) -> bytes:
    """One line: the object as compact JSON and a newline."""
    return _encoder.encode(obj) + b"\n"


def decode_request(line: bytes) -> Request:
    try:
        return _request_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed request: {exc}") from None
    except RecursionError:  # msgspec's answer to JSON nested deeper than it recurses
        raise ProtocolError("malformed request: nested too deeply") from None


OK_LINE = encode({"ok": True})


def error_line(message: str) -> bytes:
    # Whitespace is collapsed so that the error stays one line on the client's stderr.
    return encode({"ok": False, "error": " ".join(message.split())})


def connect(path: str, timeout: float = REPLY_TIMEOUT) -> socket.socket:
    """Connect to the control socket; OSError tells why not."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def request(sock: socket.socket, cmd: str, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Send one request and yield the reply's data objects as they arrive.

    Raises RemoteError for an error reply and ProtocolError when the exchange fails:
    a garbled or cut reply, a broken connection, no reply in time. Socket errors are
    translated here so that an OSError the caller sees is never the daemon's.
    """
    try:
        sock.sendall(encode({"cmd": cmd, "args": args}))
        with sock.makefile("rb") as lines:
            for line in lines:
                try:
                    obj = _reply_decoder.decode(line)
                except msgspec.DecodeError as exc:
                    raise ProtocolError(f"malformed reply from the daemon: {exc}") from None
                if "ok" not in obj:
                    yield obj
                elif obj["ok"] is True:
                    return
                else:
                    raise RemoteError(str(obj.get("error") or "unspecified error"))
    except TimeoutError:
        raise ProtocolError(f"no reply from the daemon within {sock.gettimeout()}s") from None
    except OSError as exc:
        raise ProtocolError(f"lost connection to the daemon: {exc}") from None
    raise ProtocolError("the daemon closed the connection before the end of its reply")
