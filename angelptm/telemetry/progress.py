"""The training loops' progress bar: a bar on a terminal, nothing in a log file.

tqdm redraws its bar with carriage returns several times a second; written into a file or a pipe (``nohup``,
a job scheduler, ``| tee``) that becomes thousands of partial lines. Off a terminal the bar is therefore
off, and the loops' periodic step lines (``train.log_interval``: step, loss, lr, tokens/s) are the progress
the log carries.
"""

from __future__ import annotations

import sys
from typing import IO

from tqdm import tqdm

MIN_INTERVAL_S = 1.0
"""At most one redraw a second on a terminal (tqdm's default is ten)."""


def on_terminal(stream: IO | None = None) -> bool:
    """Whether ``stream`` (default: stderr, where tqdm draws) is an interactive terminal."""
    stream = stream if stream is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def progress_bar(total: int, initial: int, shown: bool) -> tqdm:
    """A step counter for the training loop: drawn when ``shown`` (the main rank) and stderr is a terminal.

    Args:
        total: steps to train to.
        initial: steps already done (a resumed run).
        shown: whether this process may draw it at all (rank 0).
    """
    return tqdm(total=total, initial=initial, desc="train", unit="step", disable=not (shown and on_terminal()),
                dynamic_ncols=True, mininterval=MIN_INTERVAL_S)
