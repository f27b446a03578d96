"""The start-up consistency sweep: message files against the journal.

Runs in a worker thread after the listener is up, so a large spool does not
delay accepting mail. The files are the queue (as Postfix's are); the journal
holds their current state. Rules (spool_layout.md, "Recovery"):

- a temp file is an interrupted write: removed;
- a message file the journal does not know is re-adopted from its header (the
  record as accepted): a journal record lost to damage, or never written (a
  crash between the file and the journal), must not lose the mail;
- a file with a tombstone (its Delete was journaled) is left to the writer,
  which removes it before any snapshot forgets the tombstone;
- a message file that cannot be read back is moved to quarantine/;
- a journaled message without its file is reported as missing.

Only files whose queue id predates the daemon's start are judged: newer ones
may be commits in flight.
"""

from __future__ import annotations

import os
from collections.abc import Container
from dataclasses import dataclass, field

from ..ids import id_time, is_queue_id
from ..model import Message
from .durable import fsync_dir
from .layout import TMP_SUFFIX, SpoolLayout
from .message_file import CorruptMessageFile, read_message_file


@dataclass
class SweepReport:
    files: int = 0
    temp_removed: int = 0
    adopt: list[Message] = field(default_factory=list)  # intact files the journal lacks
    missing: list[str] = field(default_factory=list)
    quarantined: list[tuple[str, str]] = field(default_factory=list)


def sweep(
    layout: SpoolLayout, known: set[str], deleted: Container[str], started: float
) -> SweepReport:
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
                continue
            if queue_id in deleted:
                continue
            unseen.discard(queue_id)
            try:
                message, _ = read_message_file(path)
            except FileNotFoundError:
                continue  # removed meanwhile (delivered)
            except CorruptMessageFile as exc:
                problem = exc.reason
            except OSError as exc:
                problem = f"unreadable: {exc.strerror}"
            else:
                problem = "" if message.id == queue_id else f"file holds message {message.id}"
            if problem:
                try:
                    os.replace(path, layout.quarantine / queue_id)
                except FileNotFoundError:
                    continue
                fsync_dir(layout.quarantine)
                report.quarantined.append((queue_id, problem))
            elif queue_id not in known:
                report.adopt.append(message)
    report.missing = sorted(unseen)
    return report
