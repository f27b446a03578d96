"""How `mtaqueue-ctl` reaches the daemon: which config, which socket, a connection.

API: `socket_path(args)` is -s, else the control socket named by the daemon's config;
`load_config(args)` reads that config (-c, else the daemon's own default); `connect(path)`
opens the control socket, on which `protocol.request` then asks. Each raises `Failure`
with the one line to print: the message of the ctl's exit 1.
"""

from __future__ import annotations

import argparse
import socket

from mtaqueue.control import protocol


class Failure(Exception):
    """Ends the ctl with exit 1 and the message on stderr."""


def socket_path(args: argparse.Namespace) -> str:
    if args.socket:
        return args.socket
    from mtaqueue import config

    return config.control_socket_path(load_config(args))


def load_config(args: argparse.Namespace):
    """The daemon's config (-c, else the daemon's own default), with the -o overrides the
    daemon was given (control.socket=..., say). Read only when needed: -s works without a
    readable config."""
    from mtaqueue import config

    path = args.config or config.default_path()
    try:
        return config.load(path, args.overrides)
    except config.ConfigError as exc:
        raise Failure(str(exc)) from None
    except OSError as exc:
        raise Failure(f"cannot read config {path}: {exc.strerror or exc}") from None


def connect(path: str) -> socket.socket:
    try:
        return protocol.connect(path)
    except OSError as exc:
        hint = ""
        if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
            hint = " (is the daemon running?)"
        raise Failure(f"cannot connect to {path}: {exc.strerror or exc}{hint}") from None
