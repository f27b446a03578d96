"""The figures of bench/silent_throttle.py, from a run's provider report and records.

    figures(run, provider, learning) -> dict      targets(figures, provider) -> dict
    table([(provider, run), ...], learning) -> str (Markdown)
    print_run(run, provider, learning)            a progress line of one run

`run` is recovery_storm's Run: `report` the slow_peer's, `extra["live"]` the live p0
({"submitted": {message_id: epoch of its 250}, "failed": [...]}), `extra["latency_lessons"]`
mtaqueue's; `provider` anything with `name`, `sessions`, `rate` and `comfort_min(messages)`
(silent_throttle.Provider). Definitions and targets: silent_throttle.py's docstring.
"""

from __future__ import annotations

import statistics
from typing import Any

from recovery_storm import Run, fmt, percentile
from slow_peer import RECORD_FIELDS


def figures(run: Run, p: Any, learning: float) -> dict[str, Any]:
    rep = run.report
    comfort = rep.get("comfort", {})
    index = {name: i for i, name in enumerate(comfort.get("records_fields", RECORD_FIELDS))}
    live = run.extra.get("live", {"submitted": {}, "failed": []})
    backlog = {x.message_id: x for x in run.planned}
    wanted = set(backlog) | set(live["submitted"])
    first: dict[str, list] = {}
    for r in comfort.get("records", []):
        mid = r[index["message_id"]]
        if mid in wanted and mid not in first and r[index["reply"]] is not None:
            first[mid] = r
    rel = run.release
    total = len(wanted)  # a live p0 not submitted is a note of the run, not the sender's
    after = [r for r in first.values() if r[index["dot"]] - rel >= learning]
    past = sum(bool(r[index["past"]]) for r in after)
    has_levels = p.sessions is not None or p.rate is not None
    drain = None
    if first and len(first) == total and run.drained_at is not None:
        drain = max(r[index["reply"]] for r in first.values()) - rel
    t_min = p.comfort_min(total)
    p0_live = [
        first[mid][index["reply"]] - at for mid, at in live["submitted"].items() if mid in first
    ]
    p0_backlog = [
        first[mid][index["reply"]] - rel
        for mid, x in backlog.items()
        if x.klass == "p0" and mid in first
    ]
    samples = [x[2] for x in comfort.get("samples", []) if x[0] - rel >= learning]
    limits = [
        e["limit"]
        for t, entries in run.states
        if t >= learning
        for e in entries
        if e["destination"].startswith("mx1.provider.test")
    ]
    delays = comfort.get("delay_s", {})
    mtaqueue = run.name == "mtaqueue"
    lessons = run.extra.get("latency_lessons") or []
    return {
        "messages": total,
        "delivered": len(first),
        "after_learning": len(after),
        "past_after": past,
        "share_past": past / len(after) if after and has_levels else None,
        "share_past_all": (
            sum(bool(r[index["past"]]) for r in first.values()) / len(first)
            if first and has_levels
            else None
        ),
        "t_min": t_min,
        "drain_s": drain,
        "ratio": drain / t_min if drain else None,
        "throughput": t_min / drain if drain else None,
        "p0_live_p50": percentile(p0_live, 50),
        "p0_live_p99": percentile(p0_live, 99),
        "p0_live": f"{len(p0_live)}/{len(live['submitted']) + len(live['failed'])}",
        "p0_backlog_p99": percentile(p0_backlog, 99),
        "connections": comfort.get("connections", 0),
        "max_sessions": comfort.get("max_sessions", 0),
        "sessions_p50_after": statistics.median(samples) if samples else None,
        "throttle_delay_s": delays.get("banner", 0) + delays.get("dot_throttle", 0),
        "banner_delays": comfort.get("banner_delays", 0),
        "duplicates": rep.get("messages", {}).get("duplicate_deliveries", 0),
        "replies_4xx": rep.get("reply_classes", {}).get("4xx", 0),
        "replies_5xx": rep.get("reply_classes", {}).get("5xx", 0),
        "replies_503": rep.get("replies", {}).get("503", 0),  # pipelined DATA, RCPT refused
        "latency_cuts": sum(old is None or new < old for *_, old, new in lessons)
        if mtaqueue
        else None,
        "latency_rate_min": min((n for _, w, _, n in lessons if w == "rate"), default=None),
        "limit_p50_after": statistics.median(limits) if limits else None,
        "limit_max_after": max(limits) if limits else None,
        "peer_errors": len(rep.get("errors", [])),
    }


def targets(f: dict[str, Any], p: Any) -> dict[str, bool | None]:
    return {
        "share": None if f["share_past"] is None else f["share_past"] <= 0.20,
        "ratio": f["ratio"] is not None and f["ratio"] <= 1.5,
        "throughput": (f["throughput"] or 0) >= 0.8 if p.name == "slow" else None,
    }


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


ROWS = [
    ("messages (backlog + live p0); comfort minimum, s",
     lambda f: f"{f['messages']}; {f['t_min']:.1f}", None),
    ("past comfort after the learning period (of accepted then); all run",
     lambda f: "- (no comfort level)" if f["share_past"] is None else
     f"{pct(f['share_past'])} ({f['past_after']} of {f['after_learning']}); "
     f"{pct(f['share_past_all'])}", "share"),
    ("drain / comfort minimum (drain, s)",
     lambda f: f"{fmt(f['ratio'])} ({fmt(f['drain_s'], 1)})", "ratio"),
    ("throughput / what it allows", lambda f: fmt(f["throughput"]), "throughput"),
    ("live p0 p50 / p99, s (delivered)",
     lambda f: f"{fmt(f['p0_live_p50'])} / {fmt(f['p0_live_p99'])} ({f['p0_live']})", None),
    ("backlog p0 p99 from release, s", lambda f: fmt(f["p0_backlog_p99"]), None),
    ("connections opened; most sessions; median after learning",
     lambda f: f"{f['connections']}; {f['max_sessions']}; {fmt(f['sessions_p50_after'], 1)}", None),
    ("throttling delay imposed, s (banners delayed)",
     lambda f: f"{f['throttle_delay_s']:.0f} ({f['banner_delays']})", None),
    ("cuts learned from latency; lowest learned rate, /min; concurrency limit p50 / max after "
     "learning", lambda f: "-" if f["latency_cuts"] is None else
     f"{f['latency_cuts']}; {fmt(f['latency_rate_min'], 0)}; {fmt(f['limit_p50_after'], 1)} / "
     f"{fmt(f['limit_max_after'])}", None),
    ("delivered; duplicates; 4xx / 5xx replies (503 to a DATA after a refused RCPT)",
     lambda f: f"{f['delivered']}; {f['duplicates']}; {f['replies_4xx']} / {f['replies_5xx']} "
     f"({f['replies_503']})", None),
]  # fmt: skip


def table(results: list[tuple[Any, Run]], learning: float) -> str:
    heads = [f"{p.name}: {'mtaqueue' if r.name == 'mtaqueue' else 'Postfix'}" for p, r in results]
    out = ["| | " + " | ".join(heads) + " |", "|---" * (len(results) + 1) + "|"]
    figs = [(figures(r, p, learning), p) for p, r in results]
    for title, get, target in ROWS:
        cells = []
        for f, p in figs:
            cell = get(f)
            mark = targets(f, p)[target] if target else None
            if target == "throughput" and mark is None:
                cell = "-"
            elif mark is not None:
                cell += " ✓" if mark else " ✗"
            cells.append(cell)
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def print_run(run: Run, p: Any, learning: float) -> None:
    f = figures(run, p, learning)
    print(f"== {p.name}: {run.label}", flush=True)
    if run.error:
        print(f"ERROR: {run.error}")
    for note in run.notes:
        print(f"note: {note}")
    print(
        f"submitted {len(run.planned)} in {run.submit_s:.1f} s; delivered {f['delivered']}/"
        f"{f['messages']}, drain {fmt(f['drain_s'], 1)} s = {fmt(f['ratio'])} x comfort min "
        f"{f['t_min']:.1f} s; past comfort after {learning:g} s {pct(f['share_past'])}; "
        f"connections {f['connections']} (max sessions {f['max_sessions']}); p0 live p99 "
        f"{fmt(f['p0_live_p99'])} s; throttling delay {f['throttle_delay_s']:.0f} s",
        flush=True,
    )
    if run.extra.get("latency_lessons"):
        print(f"  learned from latency: {run.extra['latency_lessons'][:16]}")
    for failure in run.extra.get("live", {}).get("failed", [])[:3]:
        print(f"  live p0 not submitted: {failure}")
