"""The start-up consistency sweep: message files against the journal.

Runs in a worker thread after the listener is up, so a large spool does not
delay accepting mail. Rules (spool_layout.md, "Recovery"):

- a temp file is an interrupted write: removed;
- a message file with no journal record was never acknowledged (the 250 comes
  after the journal record): removed;
- a message file that cannot be read back is moved to quarantine/;
- a journaled message without its file is reported as missing.

Only files whose queue id predates the daemon's start are judged: newer ones
may be commits in flight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..ids import id_time, is_queue_id
from .durable import fsync_dir
from .layout import TMP_SUFFIX, SpoolLayout
from .message_file import CorruptMessageFile, read_message_file


@dataclass
class SweepReport:
    files: int = 0
    orphans_removed: int = 0
    temp_removed: int = 0
    missing: list[str] = field(default_factory=list)
    quarantined: list[tuple[str, str]] = field(default_factory=list)


def sweep(layout: SpoolLayout, known: set[str], started: float) -> SweepReport:
    report = SweepReport()
    unseen = {queue_id for queue_id in known if id_time(queue_id) < started}
    for directory in layout.all_message_dirs():
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        for name in names:
            queue_id = name.removesuffix(TMP_SUFFIX)
            if not is_queue_id(queue_id) or id_time(queue_id) >= started:
                continue
            path = directory / name
            report.files += 1
            if name.endswith(TMP_SUFFIX):
                path.unlink(missing_ok=True)
                report.temp_removed += 1
            elif queue_id not in known:
                path.unlink(missing_ok=True)
                report.orphans_removed += 1
            else:
                unseen.discard(queue_id)
                problem = _check_file(path, queue_id)
                if problem:
                    os.replace(path, layout.quarantine / queue_id)
                    fsync_dir(layout.quarantine)
                    report.quarantined.append((queue_id, problem))
    report.missing = sorted(unseen)
    return report


def _check_file(path, queue_id: str) -> str:
    try:
        message, _ = read_message_file(path)
    except CorruptMessageFile as exc:
        return exc.reason
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    return "" if message.id == queue_id else f"file holds message {message.id}"
