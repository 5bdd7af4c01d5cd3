"""Error types raised for user input, so callers can tell a bad config from a bug."""


class ConfigError(ValueError):
    """The JSON config (or an argument to ``initialize``) is invalid; the message says how to fix it."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the path and the cause."""


class DataError(ValueError):
    """A token dataset cannot be used as it is; the message names the file, the offset and the fix."""
