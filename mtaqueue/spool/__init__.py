"""The spool owns the disk: message files, the state journal, recovery."""
