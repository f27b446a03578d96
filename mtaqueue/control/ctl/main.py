"""`mtaqueue-ctl`: inspect and steer a running mtaqueue daemon over its control socket.

API: `main(argv=None) -> int`, the console script (also `python -m
mtaqueue.control.ctl.main`). It parses the command line (`-c FILE | -s SOCKET` and `-o
SECTION.KEY=VALUE` as the daemon takes them, then one of `subcommands.SUBCOMMANDS`),
sends the subcommand's request (or runs it) and prints the reply: with ``--json`` the
reply's data objects as JSON Lines as they arrive, else the subcommand's text. Every error
is one line on stderr: exit 2 for usage, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, TextIO

from mtaqueue.control import protocol
from mtaqueue.control.ctl import client, render
from mtaqueue.control.ctl.subcommands import SUBCOMMANDS

PROG = "mtaqueue-ctl"


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage and exits; the contract wants one line and our exit code.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect and steer a running mtaqueue daemon.")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        help="the daemon's config, to find the socket (default: as the daemon's -c:"
        " $MTAQUEUE_CONFIG, else /etc/mtaqueue/mtaqueue.toml if it exists, else the"
        " built-in defaults)",
    )
    where.add_argument("-s", "--socket", metavar="SOCKET", help="control socket path")
    parser.add_argument(
        "-o",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key, as the daemon's -o (repeatable)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, sub in SUBCOMMANDS.items():
        sub_parser = commands.add_parser(name, help=sub.help, description=sub.help)
        sub_parser.add_argument("--json", action="store_true", help="print JSON Lines")
        sub.options(sub_parser)
    return parser


def _run(args: argparse.Namespace, out: TextIO) -> None:
    sub = SUBCOMMANDS[args.command]
    try:
        if sub.run is not None:
            sub.run(args, out)
            return
        assert sub.request is not None and sub.show is not None
        cmd, cmd_args = sub.request(args)
        printer = render.print_json if args.json else sub.show
        with client.connect(client.socket_path(args)) as sock:
            printer(protocol.request(sock, cmd, cmd_args), out)
    except (protocol.RemoteError, protocol.ProtocolError) as exc:
        raise client.Failure(str(exc)) from None
    out.flush()


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        _run(args, sys.stdout)
    except UsageError as exc:
        return _fail(str(exc), 2)
    except client.Failure as exc:
        return _fail(str(exc), 1)
    except BrokenPipeError:  # protocol.request translates the socket's own errors
        # The reader (e.g. head) has gone: stop quietly, and point stdout at /dev/null
        # so that the interpreter's final flush does not complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"{PROG}: {message}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
