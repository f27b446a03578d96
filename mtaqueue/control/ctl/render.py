"""How `mtaqueue-ctl` prints the daemon's replies: for people, or as JSON Lines.

API: one `show_*(reply, out)` per kind of reply writes its objects as text for people:
`show_status`, `show_list`, `show_message`, `show_review`, `show_affected` (what hold,
flush, ... did), `show_domains`, `show_webhooks`, `show_steered` (limit, backoff, forget),
`show_hosts`, `show_unsuspended`,
`show_warmup`, `show_tls_reports`, `show_suppressions`, `show_qshape`. `print_json` writes
any reply as JSON Lines (--json), an object as it arrives. `time(epoch)` and
`duration(seconds)` are how every table writes those. `Reply`: a reply's data objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, TextIO

import msgspec

from mtaqueue.control import qshape

Reply = Iterable[dict[str, Any]]


def time(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def duration(seconds: float) -> str:
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
        return time(value)
    if key == "uptime":
        return duration(value)
    return str(value)


def print_json(reply: Reply, out: TextIO) -> None:
    encode = msgspec.json.encode
    out.writelines(encode(obj).decode() + "\n" for obj in reply)


def show_status(reply: Reply, out: TextIO) -> None:
    for status in reply:
        rows = [("messages", status["messages"]), ("recipients", status["recipients"])]
        rows += [(f"  {state}", n) for state, n in status["by_state"].items()]
        rows.append(("classes", ", ".join(f"{k} {n}" for k, n in status["by_class"].items())))
        skip = {"messages", "recipients", "by_state", "by_class"}
        rows += [(key, value) for key, value in status.items() if key not in skip]
        out.writelines(f"{key:<14} {_value(key, value)}\n" for key, value in rows)


def _recipient_line(rcpt: dict[str, Any]) -> str:
    """A recipient's line in list and review: address, state, attempts so far."""
    line = f"    {rcpt['address']}  {rcpt['state']}"
    if attempts := rcpt["attempts"]:
        line += f", {attempts} attempt{'s' if attempts > 1 else ''}"
    return line


def _held_back(waiting: dict[str, Any] | None, form: str = "{}") -> str:
    """What holds a message that looks ready (a warm-up allowance used up for the day),
    put in `form`; "" if nothing does."""
    if not waiting:
        return ""
    text = f"waiting for the warm-up allowance at {waiting['destination']}"
    return form.format(f"{text} until {time(waiting['until'])}")


def show_list(reply: Reply, out: TextIO) -> None:
    count = size = 0
    for msg in reply:
        count += 1
        size += msg["size"]
        held = "  (held)" if msg["held"] else ""
        out.write(
            f"{msg['id']} {msg['size']:>9} {time(msg['created'])} {msg['class']:<4}"
            f" {msg['sender'] or '<>'}{held}{_held_back(msg.get('waiting'), '  ({})')}\n"
        )
        for rcpt in msg["recipients"]:
            line = _recipient_line(rcpt)
            if rcpt["next_attempt"] is not None:
                line += f", next {time(rcpt['next_attempt'])}"
            if rcpt["last_reply"]:
                line += f": {rcpt['last_reply']}"
            out.write(line + "\n")
    out.write(f"-- {count} messages, {size} bytes\n")


def show_message(reply: Reply, out: TextIO) -> None:
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
                    f"  attempt        {time(attempt['time'])} {attempt['outcome']}{mx}:"
                    f" {attempt['reply']}\n"
                )


_REVIEW_REASONS = {
    "expired": "expired (held for review)",
    "revalidation": "the application could not be asked",
    "error": "an error of ours (see the log)",
    "sender_block": "a site refused our sending (release once that is fixed)",
}


def show_review(reply: Reply, out: TextIO) -> None:
    count = 0
    longest = 0.0
    for msg in reply:
        count += 1
        longest = max(longest, msg["waiting"])
        reason = _REVIEW_REASONS.get(msg["reason"], msg["reason"])
        out.write(
            f"{msg['id']} {msg['class']:<4} {msg['sender'] or '<>'}  age {duration(msg['age'])},"
            f" in review {duration(msg['waiting'])}: {reason}\n"
        )
        for rcpt in msg["recipients"]:
            line = _recipient_line(rcpt)
            if rcpt["cause"]:
                line += f", cause {rcpt['cause']}"
            if rcpt["last_reply"]:
                line += f": {rcpt['last_reply']}"
            out.write(line + "\n")
    tail = f", the longest {duration(longest)}" if count else ""
    out.write(f"-- {count} message{'s' if count != 1 else ''} in review{tail}\n")


def show_suppressions(reply: Reply, out: TextIO) -> None:
    for entry in reply:
        if entry.get("removed"):
            out.write(f"{entry['address']}: no longer suppressed\n")
        else:
            out.write(f"{entry['address']:<40} until {time(entry['until'])}  {entry['reason']}\n")


def show_affected(reply: Reply, out: TextIO) -> None:
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


def show_domains(reply: Reply, out: TextIO) -> None:
    for d in reply:
        out.write(f"{d['destination']}  ({', '.join(d.get('domains', []))})\n")
        if d.get("relay"):
            out.write(f"  relay       smarthost of {d['relay']}\n")
        if d.get("source"):
            out.write(f"  source      {d['source']}\n")
        if d.get("source_excluded_until"):
            until = time(d["source_excluded_until"])
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
            if latency := d.get("latency"):
                _show_latency(latency, out)
            if override := d.get("override"):
                limits = []
                if override.get("rate_per_minute") is not None:
                    limits.append(f"rate {_per_minute(override['rate_per_minute'])}")
                if override.get("concurrency") is not None:
                    limits.append(f"concurrency {override['concurrency']}")
                if override.get("until"):
                    limits.append(f"until {time(override['until'])}")
                out.write(f"  override    {', '.join(limits)}\n")
            if learned := d.get("learned"):
                _show_learned(learned, out)
            circuit = d.get("circuit")
            if circuit == "open" and d.get("reopen_at"):
                circuit += f" until {time(d['reopen_at'])}"
            mode = d.get("mode")
            if d.get("stage"):
                mode = f"{mode} (stage {d['stage']})"
            out.write(f"  mode        {mode}   circuit {circuit}\n")
            for host, until in d.get("suspended_hosts", {}).items():
                out.write(f"  suspended   {host} until {time(until)}\n")
            out.write(f"  4xx rate    {d.get('deferral_rate') or 0:.0%} (last 10 minutes)\n")
        for line in d.get("last_replies", []):
            out.write(f"  last        {line}\n")


def _show_latency(latency: dict, out: TextIO) -> None:
    """Reply latency: the baselines, the last round over its baseline, the last cut."""
    baselines = ", ".join(f"{kind} {s * 1000:.1f} ms" for kind, s in latency["baseline"].items())
    if baselines:
        out.write(f"  latency     baselines {baselines}\n")
    if last := latency.get("last"):
        median = f"{last['ratio']:.1f}x its baseline"
        out.write(f"    last      {last['kind']} replies: {median} ({last['verdict']})\n")
    if latency.get("knee"):
        out.write(f"    knee      {latency['knee']} connections (one more slowed its replies)\n")
    if latency.get("rate_per_minute"):
        ceiling = _per_minute(latency["rate_per_minute"])
        out.write(f"    rate      at most {ceiling} (more stretched its replies)\n")
    if slowed := latency.get("slowed"):
        cut = f"connections {slowed['from']} -> {slowed['to']}"
        if slowed.get("rate_to") != slowed.get("rate_from"):
            before = _per_minute(slowed["rate_from"]) if slowed.get("rate_from") else "none"
            cut = f"rate {before} -> {_per_minute(slowed['rate_to'])}"
        out.write(
            f"  slowed      at {time(slowed['at'])}: the {slowed['kind']} reply"
            f" {slowed['ratio']:.1f}x its baseline, {cut}\n"
        )


def _show_learned(learned: dict, out: TextIO) -> None:
    """What the destination taught: its rate and connection cap, and by which reply."""
    phase = learned.get("phase", "")
    if learned.get("paused_until"):
        phase = f"paused until {time(learned['paused_until'])}"
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


def show_webhooks(reply: Reply, out: TextIO) -> None:
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


def show_steered(reply: Reply, out: TextIO) -> None:
    for result in reply:
        until = f" until {time(result['until'])}" if result.get("until") else ""
        out.write(f"applied to {result['destinations']} destination(s){until}\n")


def show_hosts(reply: Reply, out: TextIO) -> None:
    count = 0
    for entry in reply:
        count += 1
        source = {None: "", "*": " (every source)"}.get(entry["source"], f" from {entry['source']}")
        out.write(
            f"{entry['host']}{source} until {time(entry['until'])}"
            f" (failure {entry['failures']}): {entry['reply'] or '-'}\n"
        )
        if entry["destinations"]:
            out.write(f"  destinations: {', '.join(entry['destinations'])}\n")
    if not count:
        out.write("no host is suspended\n")


def show_unsuspended(reply: Reply, out: TextIO) -> None:
    for result in reply:
        hosts = ", ".join(result["hosts"]) or "no suspended host"
        probed = len(result["destinations"])
        out.write(f"lifted: {hosts}; {probed} destination(s) get a probe connection now\n")


def show_warmup(reply: Reply, out: TextIO) -> None:
    count = 0
    for ramp in reply:
        count += 1
        out.write(f"{ramp['source']} at {ramp['destination']}: {_warmup(ramp)}\n")
    if not count:
        out.write("no warm-up ramp (no warming source has mail for a destination yet)\n")


def show_tls_reports(reply: Reply, out: TextIO) -> None:
    count = 0
    for sent in reply:
        count += 1
        rua = f" to {', '.join(sent['rua'])}" if sent.get("rua") else ""
        errors = "".join(f"\n  {uri}: {why}" for uri, why in sent.get("errors", {}).items())
        out.write(f"{sent['domain']} {sent['day']}{rua}: {sent['result']}{errors}\n")
    if not count:
        out.write("no TLS report due\n")


def show_qshape(reply: Reply, out: TextIO) -> None:
    out.write(qshape.render(list(reply)))
