"""`mtaqueue-ctl`: inspect and steer a running mtaqueue daemon over its control socket.

Each subcommand is one `Subcommand` entry: its options, the request it sends and how
it prints the reply. With ``--json`` the reply's data objects are printed as JSON
Lines as they arrive. Every error is one line on stderr: exit 2 for usage, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

from mtaqueue.control import protocol
from mtaqueue.control.ctl import render
from mtaqueue.model import RECIPIENT_STATES

PROG = "mtaqueue-ctl"


class UsageError(Exception):
    pass


class Failure(Exception):
    """Ends the ctl with exit 1 and the message on stderr."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage and exits; the contract wants one line and our exit code.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


@dataclass(frozen=True)
class Subcommand:
    help: str
    options: Callable[[argparse.ArgumentParser], None]
    request: Callable[[argparse.Namespace], tuple[str, dict[str, Any]]] | None
    show: Callable[[render.Reply, TextIO], None] | None  # human output; --json prints the objects
    run: Callable[[argparse.Namespace, TextIO], None] | None = None  # instead of one request


def _status_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "status", {}


def _list_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--class", dest="klass", metavar="CLASS", help="only this class")
    parser.add_argument(
        "--state", choices=RECIPIENT_STATES, help="only messages with a recipient in this state"
    )
    parser.add_argument("--domain", help="only messages with a recipient at this domain")
    parser.add_argument("--sender", help="only this sender ('<>' for the null sender)")
    held = parser.add_mutually_exclusive_group()
    held.add_argument("--held", action="store_const", const=True, help="only held messages")
    held.add_argument(
        "--not-held", dest="held", action="store_const", const=False, help="only other messages"
    )


def _list_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    filters = {
        "class": args.klass,
        "state": args.state,
        "domain": args.domain,
        "sender": args.sender,
        "held": args.held,
    }
    return "list", {k: v for k, v in filters.items() if v is not None}


def _show_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="queue id")


def _show_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "show", {"id": args.id}


def _no_options(parser: argparse.ArgumentParser) -> None:
    pass


def _review_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--class", dest="klass", metavar="CLASS", help="only this class")


def _review_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "review", {"class": args.klass} if args.klass else {}


def _suppress_options(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="addresses refused at RCPT TO, and why")
    add = actions.add_parser("add", help="refuse mail to an address")
    add.add_argument("address")
    add.add_argument("--for", dest="ttl", metavar="DURATION", help="default suppression.ttl")
    add.add_argument("--reason", default="")
    remove = actions.add_parser("remove", help="accept mail to an address again")
    remove.add_argument("address")
    _json_after(listing, add, remove)


def _json_after(*actions: argparse.ArgumentParser) -> None:
    """--json also after a command's action ("suppress list --json")."""
    for action in actions:
        action.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON Lines"
        )


def _suppress_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if args.action == "list":
        return "suppress_list", {}
    if args.action == "add":
        return "suppress_add", {"address": args.address, "for": args.ttl, "reason": args.reason}
    return "suppress_remove", {"address": args.address}


def _select_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ids", nargs="*", metavar="ID", help="queue ids")
    parser.add_argument("--domain", help="messages with a recipient in this domain")
    parser.add_argument("--class", dest="klass", metavar="CLASS")
    parser.add_argument("--tenant")
    parser.add_argument("--state", choices=RECIPIENT_STATES, help="a recipient in this state")
    parser.add_argument("--older-than", metavar="DURATION", help="e.g. 2h")
    parser.add_argument(
        "--review", action="store_const", const=True, help="messages in review (see review)"
    )
    parser.add_argument("--all", action="store_true", help="every message")


def _select_request(command: str) -> Callable[[argparse.Namespace], tuple[str, dict[str, Any]]]:
    def request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
        selection = {
            "ids": args.ids or None,
            "domain": args.domain,
            "class": args.klass,
            "tenant": args.tenant,
            "state": args.state,
            "older_than": args.older_than,
            "review": args.review,
            "all": args.all,
        }
        return command, selection

    return request


def _qshape_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--by", choices=("domain", "sender", "tenant"), default="domain")
    parser.add_argument("--class", dest="klass", metavar="CLASS")
    parser.add_argument("--top", type=int, default=20, help="rows besides TOTAL")


def _qshape_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "qshape", {"by": args.by, "class": args.klass, "top": args.top}


def _domains_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "domains", {}


def _webhooks_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "webhooks", {}


def _limit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", required=True, help="a domain or a destination name")
    parser.add_argument("--rate", help="messages per minute, or e.g. 100/min, 5/s")
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--for", dest="ttl", metavar="DURATION", help="until restart if left out")


def _limit_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "limit", {
        "domain": args.domain,
        "rate": args.rate,
        "concurrency": args.concurrency,
        "for": args.ttl,
    }


def _backoff_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", required=True, help="a domain or a destination name")
    parser.add_argument("--for", dest="ttl", metavar="DURATION", default="15m")


def _backoff_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "backoff", {"domain": args.domain, "for": args.ttl}


def _forget_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", required=True, help="a domain or a destination name")


def _forget_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "forget", {"domain": args.domain}


def _dkim_options(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="the TXT record of each key of DOMAIN, and whether the DNS publishes it"
    )
    check.add_argument("domain")
    _json_after(check)


def _dkim(args: argparse.Namespace, out: TextIO) -> None:
    """From the config and the key files (no daemon): exit 1 unless every key is published."""
    from mtaqueue.config import ConfigError
    from mtaqueue.control import dkim_check

    try:
        rows = dkim_check.check_domain(_config(args), args.domain)
    except (dkim_check.NoKey, ConfigError) as exc:  # ConfigError: an unreadable key file
        raise Failure(str(exc)) from None
    (render.print_json if args.json else dkim_check.show)(rows, out)
    out.flush()
    bad = [row for row in rows if row["status"] != "ok"]
    if bad:
        raise Failure(f"dkim check: {bad[0]['status']}: {bad[0]['detail']}")


def _warmup_options(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    helps = {
        "show": "each warming source's ramp at each destination",
        "restart": "put SOURCE's ramp back on its first step (a moved address, a damaged"
        " reputation); today's mail still counts against today's allowance",
        "finish": "SOURCE is warm: no warm-up allowance any more",
    }
    show, restart, finish = (actions.add_parser(a, help=h, description=h) for a, h in helps.items())
    show.add_argument("source", nargs="?", help="only this source address")
    for action in (restart, finish):
        action.add_argument("source", help="the source address, as in its [pools] table")
        action.add_argument(
            "--destination",
            metavar="DEST",
            help="a destination as warmup show names it, or a domain it serves"
            " (default: every destination SOURCE has a ramp at)",
        )
    _json_after(show, restart, finish)


def _warmup_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if args.action == "show":
        return "warmup_show", {"source": args.source}
    return f"warmup_{args.action}", {"source": args.source, "destination": args.destination}


def _tls_report_options(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    help = "send the TLS reports of the days that have ended now, without waiting for their time"
    send = actions.add_parser("send", help=help, description=help)
    send.add_argument("--today", action="store_true", help="and today's so far")
    _json_after(send)


def _tls_report_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "tls_report_send", {"today": args.today}


def _top_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--count", type=int, default=0, help="stop after N screens (0: never)")
    parser.add_argument("--rows", type=int, default=20)


def _waiting(destination: dict[str, Any]) -> int:
    """Messages for the destination, ready or deferred."""
    return sum(destination.get("queued", {}).values()) + sum(
        destination.get("deferred", {}).values()
    )


def _top(args: argparse.Namespace, out: TextIO) -> None:
    """A live view of the busiest destinations, refreshed in the terminal."""
    path = _socket_path(args)
    screens = 0
    while True:
        with _connect(path) as sock:
            status = next(iter(protocol.request(sock, "status", {})))
        with _connect(path) as sock:
            destinations = list(protocol.request(sock, "domains", {}))
        destinations.sort(key=lambda d: -_waiting(d))
        if out.isatty():
            out.write("\033[H\033[2J")  # home and clear
        out.write(
            f"mtaqueue {status.get('version', '')}  {render.time(time.time())}  "
            f"messages {status.get('messages', 0)}  "
            f"by state {status.get('by_state', {})}\n\n"
        )
        header = f"{'destination':<40} {'waiting':>7} {'conn':>7} {'mode':>8} {'circuit':>9} 4xx"
        out.write(header + "\n")
        for d in destinations[: args.rows]:
            waiting = _waiting(d)
            conns = f"{d.get('active', 0)}/{d.get('limit', '-')}"
            out.write(
                f"{d['destination'][:40]:<40} {waiting:>7} {conns:>7} {d.get('mode') or '-':>8}"
                f" {d.get('circuit') or '-':>9} {d.get('deferral_rate') or 0:.0%}\n"
            )
        out.flush()
        screens += 1
        if args.count and screens >= args.count:
            return
        time.sleep(args.interval)


SUBCOMMANDS: dict[str, Subcommand] = {
    "status": Subcommand(
        "counts and daemon info", _no_options, _status_request, render.show_status
    ),
    "list": Subcommand(
        "one entry per queued message", _list_options, _list_request, render.show_list
    ),
    "show": Subcommand(
        "every field of one message", _show_options, _show_request, render.show_message
    ),
    "review": Subcommand(
        "mail held for someone's decision (at expiry...), longest waiting first",
        _review_options,
        _review_request,
        render.show_review,
    ),
    "hold": Subcommand(
        "keep messages from delivery (and expiry)",
        _select_options,
        _select_request("hold"),
        render.show_affected,
    ),
    "release": Subcommand(
        "resume held messages", _select_options, _select_request("release"), render.show_affected
    ),
    "flush": Subcommand(
        "make deferred messages due now (pacing still applies)",
        _select_options,
        _select_request("flush"),
        render.show_affected,
    ),
    "qshape": Subcommand(
        "queue by domain and age (minutes), like Postfix's qshape",
        _qshape_options,
        _qshape_request,
        render.show_qshape,
    ),
    "requeue": Subcommand(
        "look the domains up again and retry now (pacing still applies)",
        _select_options,
        _select_request("requeue"),
        render.show_affected,
    ),
    "delete": Subcommand(
        "remove messages without notice",
        _select_options,
        _select_request("delete"),
        render.show_affected,
    ),
    "bounce": Subcommand(
        "fail messages now, with a DSN to the sender",
        _select_options,
        _select_request("bounce"),
        render.show_affected,
    ),
    "top": Subcommand("live view of the busiest destinations", _top_options, None, None, _top),
    "domains": Subcommand(
        "state of each destination", _no_options, _domains_request, render.show_domains
    ),
    "webhooks": Subcommand(
        "each webhook endpoint: its backlog, failures and last error",
        _no_options,
        _webhooks_request,
        render.show_webhooks,
    ),
    "limit": Subcommand(
        "runtime rate/concurrency for a destination",
        _limit_options,
        _limit_request,
        render.show_steered,
    ),
    "backoff": Subcommand(
        "put a destination in backoff mode", _backoff_options, _backoff_request, render.show_steered
    ),
    "forget": Subcommand(
        "learn a destination's rate and connection cap anew (slow start)",
        _forget_options,
        _forget_request,
        render.show_steered,
    ),
    "dkim": Subcommand(
        "DKIM keys: check DOMAIN prints the DNS records to publish and checks the DNS",
        _dkim_options,
        None,
        None,
        _dkim,
    ),
    "warmup": Subcommand(
        "warm-up ramps of pool sources: show, restart (from the first step), finish (warm)",
        _warmup_options,
        _warmup_request,
        render.show_warmup,
    ),
    "tls-report": Subcommand(
        "TLS-RPT (RFC 8460): send the reports due now",
        _tls_report_options,
        _tls_report_request,
        render.show_tls_reports,
    ),
    "suppress": Subcommand(
        "the suppression list (list, add, remove)",
        _suppress_options,
        _suppress_request,
        render.show_suppressions,
    ),
}


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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, sub in SUBCOMMANDS.items():
        sub_parser = commands.add_parser(name, help=sub.help, description=sub.help)
        sub_parser.add_argument("--json", action="store_true", help="print JSON Lines")
        sub.options(sub_parser)
    return parser


def _socket_path(args: argparse.Namespace) -> str:
    if args.socket:
        return args.socket
    from mtaqueue import config

    return config.control_socket_path(_config(args))


def _config(args: argparse.Namespace):
    """The daemon's config (-c, else the daemon's own default). Read only when needed:
    -s works without a readable config."""
    from mtaqueue import config

    path = args.config or config.default_path()
    try:
        return config.load(path, [])
    except config.ConfigError as exc:
        raise Failure(str(exc)) from None
    except OSError as exc:
        raise Failure(f"cannot read config {path}: {exc.strerror or exc}") from None


def _connect(path: str) -> socket.socket:
    try:
        return protocol.connect(path)
    except OSError as exc:
        hint = ""
        if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
            hint = " (is the daemon running?)"
        raise Failure(f"cannot connect to {path}: {exc.strerror or exc}{hint}") from None


def _run(args: argparse.Namespace, out: TextIO) -> None:
    sub = SUBCOMMANDS[args.command]
    if sub.run is not None:
        try:
            sub.run(args, out)
        except (protocol.RemoteError, protocol.ProtocolError) as exc:
            raise Failure(str(exc)) from None
        return
    assert sub.request is not None and sub.show is not None
    cmd, cmd_args = sub.request(args)
    printer = render.print_json if args.json else sub.show
    with _connect(_socket_path(args)) as sock:
        try:
            printer(protocol.request(sock, cmd, cmd_args), out)
        except (protocol.RemoteError, protocol.ProtocolError) as exc:
            raise Failure(str(exc)) from None
    out.flush()


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        _run(args, sys.stdout)
    except UsageError as exc:
        return _fail(str(exc), 2)
    except Failure as exc:
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
