"""Where angelptm's log lines go in a script that never configured logging.

DeepSpeed's logger carries its own stdout handler, and its pipeline engine prints its loss lines, so a plain
``train.py`` shows them. Python's logging shows nothing below WARNING until the application configures it,
which would hide the compute-dtype line, the ``steps_per_print`` lines and the pipeline's loss lines (issue
28). :func:`show_logs_in_plain_script` gives the ``angelptm`` logger a stdout handler at INFO, in
DeepSpeed's format, only where the application has configured no logging; an application that has
(``logging.basicConfig``, ``pretrain.py``, pytest) keeps deciding what is shown, and the handler stays silent
while any other handler would take the record, so nothing is printed twice.
"""

from __future__ import annotations

import logging
import sys

PACKAGE_LOGGER = "angelptm"
COMPOSED_LOGGERS = ("zero_cache", "moe", "autopipe")
"""The packages angelptm composes log under their own names (``zero_cache.base.native``'s "compiling ..." line): they
get the same handler, or their INFO lines would not show in a plain script."""
FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"
"""DeepSpeed's log format (deepspeed/utils/logging.py), so the lines read as a DeepSpeed user expects."""


class PlainScriptHandler(logging.StreamHandler):
    """Writes to stdout a record no other handler on its way to the root would take."""

    def __init__(self) -> None:
        super().__init__(stream=sys.stdout)
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if not _another_handler_takes(logging.getLogger(record.name), self):
            super().emit(record)


def _another_handler_takes(logger: logging.Logger | None, handler: logging.Handler) -> bool:
    while logger is not None:
        if any(other is not handler for other in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def set_log_level(level: str) -> None:
    """The config's ``log_level`` (DeepSpeed's key): the level of every angelptm log line, as DeepSpeed's engine
    sets its logger's."""
    logging.getLogger(PACKAGE_LOGGER).setLevel(level.upper())


def show_logs_in_plain_script() -> None:
    """Show angelptm's INFO lines on stdout when the application has configured no logging (idempotent).

    Called by ``initialize()``. Where the root logger or the ``angelptm`` logger already has a handler, or the
    ``angelptm`` logger has a level set, nothing changes.
    """
    package = logging.getLogger(PACKAGE_LOGGER)
    if any(isinstance(handler, PlainScriptHandler) for handler in package.handlers):
        return
    if logging.getLogger().handlers or package.handlers or package.level != logging.NOTSET:
        return
    for name in (PACKAGE_LOGGER, *COMPOSED_LOGGERS):
        logger = logging.getLogger(name)
        if not logger.handlers and logger.level == logging.NOTSET:
            logger.addHandler(PlainScriptHandler())
            logger.setLevel(logging.INFO)
