"""`ConfigError`: a config file or override that cannot be used.

Its message is one line that starts with the key path, because the daemon and the ctl print it
as is and exit.
"""


class ConfigError(Exception):
    """A config file or override that cannot be used; str() is one line naming the key."""
