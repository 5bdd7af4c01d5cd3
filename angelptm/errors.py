"""Error types raised for user input, so callers can tell a bad config from a bug."""


class ConfigError(ValueError):
    """The JSON config (or an argument to ``initialize``) is invalid; the message says how to fix it."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument to ``initialize`` (or another entry point) has a type it does not take; the message names the
    argument, its type and what is allowed. Also a ``TypeError``, as Python's own for a wrong type is."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the path and the cause."""


class DataError(ValueError):
    """A token dataset cannot be used as it is; the message names the file, the offset and the fix."""


class DiskFullError(CheckpointError, OSError):
    """A save ran out of disk space (``errno`` ENOSPC or EDQUOT, ``filename`` the file being written); the
    message says how much room a checkpoint needs and how to make it. Also an ``OSError``, as the write's was."""

    def __init__(self, message: str, errno_code: int, filename: str | None) -> None:
        OSError.__init__(self, errno_code, message, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message
