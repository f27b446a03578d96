"""The subcommands of `mtaqueue-ctl`: what each accepts and what it asks the daemon.

API: `SUBCOMMANDS` maps each command's name to its `Subcommand`: `help`, `options(parser)`
(its arguments), `request(args)` (the daemon's command and its arguments) and `show(reply,
out)` (its text, from `render`); or, for a command that is more than one request (top) or
none (dkim check, from the config and the key files), `run(args, out)`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from mtaqueue.control.ctl import client, render, top
from mtaqueue.model import RECIPIENT_STATES


@dataclass(frozen=True)
class Subcommand:
    help: str
    options: Callable[[argparse.ArgumentParser], None]
    request: Callable[[argparse.Namespace], tuple[str, dict[str, Any]]] | None
    show: Callable[[render.Reply, TextIO], None] | None  # human output; --json prints the objects
    run: Callable[[argparse.Namespace, TextIO], None] | None = None  # instead of one request


def _no_options(parser: argparse.ArgumentParser) -> None:
    pass


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


def _hosts_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "hosts", {}


def _unsuspend_options(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("host", nargs="?", help="a host as `hosts` shows it, or its name")
    which.add_argument("--domain", help="every host of the destinations serving this domain")


def _unsuspend_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "unsuspend", {"host": args.host, "domain": args.domain}


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
        rows = dkim_check.check_domain(client.load_config(args), args.domain)
    except (dkim_check.NoKey, ConfigError) as exc:  # ConfigError: an unreadable key file
        raise client.Failure(str(exc)) from None
    (render.print_json if args.json else dkim_check.show)(rows, out)
    out.flush()
    bad = [row for row in rows if row["status"] != "ok"]
    if bad:
        raise client.Failure(f"dkim check: {bad[0]['status']}: {bad[0]['detail']}")


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
    "top": Subcommand("live view of the busiest destinations", top.options, None, None, top.run),
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
    "hosts": Subcommand(
        "suspended hosts: the reply that suspended each, and until when",
        _no_options,
        _hosts_request,
        render.show_hosts,
    ),
    "unsuspend": Subcommand(
        "lift a host's suspension (HOST, or --domain D): one probe connection goes now",
        _unsuspend_options,
        _unsuspend_request,
        render.show_unsuspended,
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
