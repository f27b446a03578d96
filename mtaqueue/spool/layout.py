"""Where things live under the spool directory (see spool_layout.md).

Message files are spread over 16 x 256 directories chosen from the time bits of
the queue id (a 65 ms window, cycling every ~4.5 min): mail committed together
shares a directory, so one directory fsync covers a whole group commit, while a
large queue still spreads evenly (1M messages -> ~250 files per directory).
"""

from __future__ import annotations

import os
from pathlib import Path

MESSAGE_DIR = "msg"
JOURNAL_DIR = "journal"
QUARANTINE_DIR = "quarantine"
LOCK_FILE = "lock"
EVENTS_DIR = "events"  # the event log and the endpoints' cursors (event_log.py)
LEARNED_FILE = "learned.json"  # what destinations taught the shapers (statefile.py)
EGRESS_FILE = "egress.json"  # sources out for a destination, IPv4-only destinations
MTA_STS_FILE = "mta_sts.json"  # the MTA-STS policies cached (delivery/mta_sts.py)
TLS_REPORTS_FILE = "tls_reports.json"  # TLS-RPT counts and reports under way
TMP_SUFFIX = ".tmp"


class SpoolLayout:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.messages = self.root / MESSAGE_DIR
        self.journal = self.root / JOURNAL_DIR
        self.quarantine = self.root / QUARANTINE_DIR
        self.events = self.root / EVENTS_DIR
        self.lock = self.root / LOCK_FILE
        self.learned = self.root / LEARNED_FILE
        self.egress = self.root / EGRESS_FILE
        self.mta_sts = self.root / MTA_STS_FILE
        self.tls_reports = self.root / TLS_REPORTS_FILE

    def message_dir(self, queue_id: str) -> Path:
        return self.messages / queue_id[6] / queue_id[7:9]

    def message_path(self, queue_id: str) -> Path:
        return self.message_dir(queue_id) / queue_id

    def tmp_path(self, queue_id: str) -> Path:
        return self.message_dir(queue_id) / (queue_id + TMP_SUFFIX)

    def all_message_dirs(self) -> list[Path]:
        return [self.messages / f"{a:X}" / f"{b:02X}" for a in range(16) for b in range(256)]

    def create(self) -> None:
        """Make every directory up front, so the accept path never calls mkdir.

        All private to the daemon's user (0700): file names are queue ids, and the
        files hold the mail. A spool made by an older version is tightened at its
        top, which closes everything below it.
        """
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (self.root, self.journal, self.quarantine, self.messages, self.events):
            path.mkdir(mode=0o700, exist_ok=True)
            if path.stat().st_mode & 0o777 != 0o700:
                path.chmod(0o700)
        for a in range(16):
            (self.messages / f"{a:X}").mkdir(mode=0o700, exist_ok=True)
        for path in self.all_message_dirs():
            path.mkdir(mode=0o700, exist_ok=True)
