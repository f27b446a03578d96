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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn, TextIO

import msgspec

from mtaqueue.control import protocol
from mtaqueue.control.qshape import render as render_qshape
from mtaqueue.model import RECIPIENT_STATES

PROG = "mtaqueue-ctl"

Reply = Iterable[dict[str, Any]]


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
    show: Callable[[Reply, TextIO], None] | None  # human output; --json prints the objects
    run: Callable[[argparse.Namespace, TextIO], None] | None = None  # instead of one request


def _time(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def _duration(seconds: float) -> str:
    """E.g. "45s", "3m 05s", "2h 00m 10s", "1d 04h 00m 00s"."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        del parts[0]
    first, *rest = parts
    return " ".join([f"{first[0]}{first[1]}", *(f"{n:02}{unit}" for n, unit in rest)])


def _value(key: str, value: Any) -> str:
    if key == "sender" and value == "":
        return "<>"
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if key in ("created", "expires", "next_attempt"):
        return _time(value)
    if key == "uptime":
        return _duration(value)
    return str(value)


# status


def _status_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "status", {}


def _status_show(reply: Reply, out: TextIO) -> None:
    for status in reply:
        rows = [("messages", status["messages"]), ("recipients", status["recipients"])]
        rows += [(f"  {state}", n) for state, n in status["by_state"].items()]
        rows.append(("classes", ", ".join(f"{k} {n}" for k, n in status["by_class"].items())))
        skip = {"messages", "recipients", "by_state", "by_class"}
        rows += [(key, value) for key, value in status.items() if key not in skip]
        out.writelines(f"{key:<14} {_value(key, value)}\n" for key, value in rows)


# list


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


def _recipient_line(rcpt: dict[str, Any]) -> str:
    """A recipient's line in list and review: address, state, attempts so far."""
    line = f"    {rcpt['address']}  {rcpt['state']}"
    if attempts := rcpt["attempts"]:
        line += f", {attempts} attempt{'s' if attempts > 1 else ''}"
    return line


def _list_show(reply: Reply, out: TextIO) -> None:
    count = size = 0
    for msg in reply:
        count += 1
        size += msg["size"]
        held = "  (held)" if msg["held"] else ""
        out.write(
            f"{msg['id']} {msg['size']:>9} {_time(msg['created'])} {msg['class']:<4}"
            f" {msg['sender'] or '<>'}{held}{_held_back(msg.get('waiting'), '  ({})')}\n"
        )
        for rcpt in msg["recipients"]:
            line = _recipient_line(rcpt)
            if rcpt["next_attempt"] is not None:
                line += f", next {_time(rcpt['next_attempt'])}"
            if rcpt["last_reply"]:
                line += f": {rcpt['last_reply']}"
            out.write(line + "\n")
    out.write(f"-- {count} messages, {size} bytes\n")


# show


def _show_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="queue id")


def _show_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "show", {"id": args.id}


def _held_back(waiting: dict[str, Any] | None, form: str = "{}") -> str:
    """What holds a message that looks ready (a warm-up allowance used up for the day),
    put in `form`; "" if nothing does."""
    if not waiting:
        return ""
    text = f"waiting for the warm-up allowance at {waiting['destination']}"
    return form.format(f"{text} until {_time(waiting['until'])}")


def _show_show(reply: Reply, out: TextIO) -> None:
    for msg in reply:
        for key, value in msg.items():
            if key == "waiting":
                out.write(f"{key:<16} {_held_back(value) or '-'}\n")
            elif key != "recipients":
                out.write(f"{key:<16} {_value(key, value)}\n")
        for rcpt in msg["recipients"]:
            out.write(f"recipient        {rcpt['address']}\n")
            for key, value in rcpt.items():
                if key not in ("address", "history"):
                    out.write(f"  {key:<14} {_value(key, value)}\n")
            for attempt in rcpt.get("history", []):
                mx = f" via {attempt['mx']}" if attempt["mx"] else ""
                out.write(
                    f"  attempt        {_time(attempt['time'])} {attempt['outcome']}{mx}:"
                    f" {attempt['reply']}\n"
                )


def _no_options(parser: argparse.ArgumentParser) -> None:
    pass


# review


def _review_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--class", dest="klass", metavar="CLASS", help="only this class")


def _review_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "review", {"class": args.klass} if args.klass else {}


REVIEW_REASONS = {
    "expired": "expired (held for review)",
    "revalidation": "the application could not be asked",
    "error": "an error of ours (see the log)",
}


def _review_show(reply: Reply, out: TextIO) -> None:
    count = 0
    longest = 0.0
    for msg in reply:
        count += 1
        longest = max(longest, msg["waiting"])
        reason = REVIEW_REASONS.get(msg["reason"], msg["reason"])
        out.write(
            f"{msg['id']} {msg['class']:<4} {msg['sender'] or '<>'}  age {_duration(msg['age'])},"
            f" in review {_duration(msg['waiting'])}: {reason}\n"
        )
        for rcpt in msg["recipients"]:
            line = _recipient_line(rcpt)
            if rcpt["cause"]:
                line += f", cause {rcpt['cause']}"
            if rcpt["last_reply"]:
                line += f": {rcpt['last_reply']}"
            out.write(line + "\n")
    tail = f", the longest {_duration(longest)}" if count else ""
    out.write(f"-- {count} message{'s' if count != 1 else ''} in review{tail}\n")


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


def _suppress_show(reply: Reply, out: TextIO) -> None:
    for entry in reply:
        if entry.get("removed"):
            out.write(f"{entry['address']}: no longer suppressed\n")
        else:
            out.write(f"{entry['address']:<40} until {_time(entry['until'])}  {entry['reason']}\n")


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


def _count_show(reply: Reply, out: TextIO) -> None:
    for result in reply:
        for verb, count in result.items():
            out.write(f"{verb} {count} message{'s' if count != 1 else ''}\n")


def _counts(counts: dict[str, int] | None) -> str:
    return ", ".join(f"{k} {n}" for k, n in (counts or {}).items() if n) or "none"


def _per_minute(rate: float) -> str:
    # A tenth is enough for people (a learned rate has many digits), and no exponent.
    return f"{round(rate, 1):g}/min" if rate else "unlimited"


def _warmup(w: dict) -> str:
    if w["allowance"] is None:
        return f"done after {w['steps']} steps (no limit), sent today {w['sent_today']}"
    held = f", held (deferral rate {w['last_rate']:.0%})" if w["held"] else ""
    return (
        f"step {w['step']}/{w['steps']}{held}: sent today {w['sent_today']}"
        f" of {w['allowance']}, deferred {w['deferred_today']}"
    )


def _domains_show(reply: Reply, out: TextIO) -> None:
    for d in reply:
        out.write(f"{d['destination']}  ({', '.join(d.get('domains', []))})\n")
        if d.get("relay"):
            out.write(f"  relay       smarthost of {d['relay']}\n")
        if d.get("source"):
            out.write(f"  source      {d['source']}\n")
        if d.get("source_excluded_until"):
            until = _time(d["source_excluded_until"])
            out.write(f"  excluded    until {until} (a blocklist reply; the pool's others go on)\n")
        if d.get("ipv4_only"):
            out.write("  families    IPv4 only (it refused our IPv6)\n")
        if d.get("warmup"):
            out.write(f"  warm-up     {_warmup(d['warmup'])}\n")
        out.write(f"  queued      {_counts(d.get('queued'))}   (messages ready to go)\n")
        out.write(f"  deferred    {_counts(d.get('deferred'))}   (messages waiting to retry)\n")
        if not d.get("routed", True):
            out.write("  state       none: not routed since the start\n")
        else:
            out.write(f"  connections {d.get('active')} active / limit {d.get('limit')}\n")
            out.write(
                f"  rates       {_per_minute(d.get('messages_per_minute', 0))} messages,"
                f" {_per_minute(d.get('connections_per_minute', 0))} connections\n"
            )
            if override := d.get("override"):
                limits = []
                if override.get("rate_per_minute") is not None:
                    limits.append(f"rate {_per_minute(override['rate_per_minute'])}")
                if override.get("concurrency") is not None:
                    limits.append(f"concurrency {override['concurrency']}")
                if override.get("until"):
                    limits.append(f"until {_time(override['until'])}")
                out.write(f"  override    {', '.join(limits)}\n")
            if learned := d.get("learned"):
                _learned_show(learned, out)
            circuit = d.get("circuit")
            if circuit == "open" and d.get("reopen_at"):
                circuit += f" until {_time(d['reopen_at'])}"
            mode = d.get("mode")
            if d.get("stage"):
                mode = f"{mode} (stage {d['stage']})"
            out.write(f"  mode        {mode}   circuit {circuit}\n")
            for host, until in d.get("suspended_hosts", {}).items():
                out.write(f"  suspended   {host} until {_time(until)}\n")
            out.write(f"  4xx rate    {d.get('deferral_rate') or 0:.0%} (last 10 minutes)\n")
        for line in d.get("last_replies", []):
            out.write(f"  last        {line}\n")


def _learned_show(learned: dict, out: TextIO) -> None:
    """What the destination taught: its rate and connection cap, and by which reply."""
    phase = learned.get("phase", "")
    if learned.get("paused_until"):
        phase = f"paused until {_time(learned['paused_until'])}"
    # Slow start probes too; the probing phase needs no second word for it.
    probing = ", probing" if learned.get("probing") and phase != "probing" else ""
    out.write(f"  learned     rate {_per_minute(learned['rate_per_minute'])} ({phase}{probing})")
    if learned.get("good_per_minute"):
        out.write(f", it took {_per_minute(learned['good_per_minute'])}")
    out.write("\n")
    out.write(f"    taught by {learned.get('rate_reply') or 'nothing yet (slow start)'}\n")
    if learned.get("concurrency"):
        out.write(f"  learned     at most {learned['concurrency']} connections\n")
        out.write(f"    taught by {learned.get('concurrency_reply')}\n")


def _qshape_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--by", choices=("domain", "sender", "tenant"), default="domain")
    parser.add_argument("--class", dest="klass", metavar="CLASS")
    parser.add_argument("--top", type=int, default=20, help="rows besides TOTAL")


def _qshape_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "qshape", {"by": args.by, "class": args.klass, "top": args.top}


def _qshape_show(reply: Reply, out: TextIO) -> None:
    out.write(render_qshape(list(reply)))


def _domains_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "domains", {}


def _webhooks_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "webhooks", {}


def _webhooks_show(reply: Reply, out: TextIO) -> None:
    rows = list(reply)
    if not rows:
        out.write("no webhooks configured\n")
    for w in rows:
        age = w.get("oldest_age")
        waiting = f", oldest {age:.0f} s old" if age is not None else ""
        out.write(f"{w['name']}  {w['url']}\n")
        out.write(f"  backlog  {w['backlog']} events{waiting}\n")
        out.write(f"  sent     {w['sent']}, dropped (too old) {w['dropped']}\n")
        if w.get("failures"):
            out.write(f"  failing  {w['failures']} times in a row: {w['last_error']}\n")


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


def _steer_show(reply: Reply, out: TextIO) -> None:
    for result in reply:
        until = f" until {_time(result['until'])}" if result.get("until") else ""
        out.write(f"applied to {result['destinations']} destination(s){until}\n")


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
    (_print_json if args.json else dkim_check.show)(rows, out)
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


def _warmup_show(reply: Reply, out: TextIO) -> None:
    count = 0
    for ramp in reply:
        count += 1
        out.write(f"{ramp['source']} at {ramp['destination']}: {_warmup(ramp)}\n")
    if not count:
        out.write("no warm-up ramp (no warming source has mail for a destination yet)\n")


def _tls_report_options(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    help = "send the TLS reports of the days that have ended now, without waiting for their time"
    send = actions.add_parser("send", help=help, description=help)
    send.add_argument("--today", action="store_true", help="and today's so far")
    _json_after(send)


def _tls_report_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "tls_report_send", {"today": args.today}


def _tls_report_show(reply: Reply, out: TextIO) -> None:
    count = 0
    for sent in reply:
        count += 1
        rua = f" to {', '.join(sent['rua'])}" if sent.get("rua") else ""
        errors = "".join(f"\n  {uri}: {why}" for uri, why in sent.get("errors", {}).items())
        out.write(f"{sent['domain']} {sent['day']}{rua}: {sent['result']}{errors}\n")
    if not count:
        out.write("no TLS report due\n")


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
            f"mtaqueue {status.get('version', '')}  {_time(time.time())}  "
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
    "status": Subcommand("counts and daemon info", _no_options, _status_request, _status_show),
    "list": Subcommand("one entry per queued message", _list_options, _list_request, _list_show),
    "show": Subcommand("every field of one message", _show_options, _show_request, _show_show),
    "review": Subcommand(
        "mail held for someone's decision (at expiry...), longest waiting first",
        _review_options,
        _review_request,
        _review_show,
    ),
    "hold": Subcommand(
        "keep messages from delivery (and expiry)",
        _select_options,
        _select_request("hold"),
        _count_show,
    ),
    "release": Subcommand(
        "resume held messages", _select_options, _select_request("release"), _count_show
    ),
    "flush": Subcommand(
        "make deferred messages due now (pacing still applies)",
        _select_options,
        _select_request("flush"),
        _count_show,
    ),
    "qshape": Subcommand(
        "queue by domain and age (minutes), like Postfix's qshape",
        _qshape_options,
        _qshape_request,
        _qshape_show,
    ),
    "requeue": Subcommand(
        "look the domains up again and retry now (pacing still applies)",
        _select_options,
        _select_request("requeue"),
        _count_show,
    ),
    "delete": Subcommand(
        "remove messages without notice", _select_options, _select_request("delete"), _count_show
    ),
    "bounce": Subcommand(
        "fail messages now, with a DSN to the sender",
        _select_options,
        _select_request("bounce"),
        _count_show,
    ),
    "top": Subcommand("live view of the busiest destinations", _top_options, None, None, _top),
    "domains": Subcommand(
        "state of each destination", _no_options, _domains_request, _domains_show
    ),
    "webhooks": Subcommand(
        "each webhook endpoint: its backlog, failures and last error",
        _no_options,
        _webhooks_request,
        _webhooks_show,
    ),
    "limit": Subcommand(
        "runtime rate/concurrency for a destination", _limit_options, _limit_request, _steer_show
    ),
    "backoff": Subcommand(
        "put a destination in backoff mode", _backoff_options, _backoff_request, _steer_show
    ),
    "forget": Subcommand(
        "learn a destination's rate and connection cap anew (slow start)",
        _forget_options,
        _forget_request,
        _steer_show,
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
        _warmup_show,
    ),
    "tls-report": Subcommand(
        "TLS-RPT (RFC 8460): send the reports due now",
        _tls_report_options,
        _tls_report_request,
        _tls_report_show,
    ),
    "suppress": Subcommand(
        "the suppression list (list, add, remove)",
        _suppress_options,
        _suppress_request,
        _suppress_show,
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


def _print_json(reply: Reply, out: TextIO) -> None:
    encode = msgspec.json.encode
    out.writelines(encode(obj).decode() + "\n" for obj in reply)


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
    printer = _print_json if args.json else sub.show
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
