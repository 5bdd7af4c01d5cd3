"""``deepspeed.utils.logging``: the package's logger under DeepSpeed's names (Lightning imports this module).

``logger`` is the ``angelptm`` logger; ``log_dist`` logs on the given ranks only; ``warning_once`` once per
message; ``LoggerFactory.create_logger`` hands out child loggers; ``should_log_le`` compares levels by name.
"""

from __future__ import annotations

import functools
import logging
from typing import Iterable

import torch.distributed as dist

logger = logging.getLogger("angelptm")
"""What DeepSpeed scripts and Lightning call ``deepspeed.utils.logging.logger``."""

log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


class LoggerFactory:
    """DeepSpeed's factory: ``create_logger(name)`` returns a child of the package logger."""

    @staticmethod
    def create_logger(name: str | None = None, level: int = logging.INFO) -> logging.Logger:
        created = logger.getChild(name) if name and name != "angelptm" else logger
        created.setLevel(level)
        return created


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks only (None or -1 among them: every rank), prefixed with the rank."""
    ranks = list(ranks) if ranks is not None else [-1]
    if -1 in ranks or _rank() in ranks:
        logger.log(level, "[Rank %d] %s", _rank(), message)


@functools.lru_cache(None)
def warning_once(message: str) -> None:
    """``logger.warning(message)``, once per distinct message in the process."""
    logger.warning(message)


logger.warning_once = warning_once  # type: ignore[attr-defined]  (DeepSpeed's logger has the method)


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the package logger's level is at or below ``max_log_level_str`` ("info", "warning", ...).

    Raises:
        ValueError: an unknown level name.
    """
    name = max_log_level_str.lower()
    if name not in log_levels:
        raise ValueError(f"{max_log_level_str!r} is not one of the log levels {list(log_levels)}")
    return logger.getEffectiveLevel() <= log_levels[name]


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def print_json_dist(message: dict, ranks: Iterable[int] | None = None, path: str | None = None) -> None:
    """Log a dict as JSON on the given ranks (``path``, DeepSpeed's file output, is not written)."""
    import json

    log_dist(json.dumps(message, default=str), ranks)
