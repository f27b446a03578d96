"""The spool's failures, as its callers see them and answer them.

`StorageFull` (answered 452 4.3.1), `StorageError` (451 4.3.0), `SpoolLocked` (another
daemon owns the spool); `WRITER_DOWN` and `DISK_LOW`, the replies to new mail while it
cannot be taken (`Spool.refusal`).
"""

WRITER_DOWN = "451 4.3.0 Spool writer restarting, try again later"
DISK_LOW = "452 4.3.1 Insufficient system storage"


class StorageFull(Exception):
    """No room on the spool's file system (answer 452 4.3.1)."""


class StorageError(Exception):
    """The spool could not be written (answer 451 4.3.0)."""


class SpoolLocked(Exception):
    """Another daemon owns this spool."""
