"""Heartbeats between the ranks of a job, so that a dead or stopped rank ends the job with its name.

What it sees: a process that died or stopped as a whole (SIGKILL, SIGSTOP, a crashed host, a hung driver
call that holds the interpreter). What it does not: a rank whose main thread is stuck while the process
lives (a deadlock in Python code, a collective waiting on a mismatched peer); its heartbeat thread still
beats, and ``comms.timeout_s`` ends such a job.

Why: gloo fails a collective at once when a peer process dies (its sockets close), but the error names a
socket address, not a rank; a rank that hangs, or a dead one under NCCL (which does not notice), leaves
the others waiting out the whole collective timeout (``comms.timeout_s``, 10 minutes by default).

How: each rank's daemon thread adds 1 to its counter in the job's rendezvous store every
``lost_rank_after_s / 10`` seconds and watches the next rank's counter (a ring: constant store traffic per
rank at any world size; some live rank always watches a dead one). A counter that stands still for
``lost_rank_after_s`` marks that rank lost: the watcher publishes it in the store, every rank reads it
within one beat, logs it, and exits unless its main thread has ended first (:data:`EXIT_CODE`,
``os._exit``: the main thread may be blocked inside a collective; checkpoints are atomic and swap files
nameless, so a hard exit leaves nothing half-done). A rank whose interpreter exits marks itself done
first, so that ranks ending at different times are not taken for lost, unless an uncaught exception
ended it (``sys.excepthook`` is chained to tell).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_CODE = 3
"""Exit status of a rank that stops because another rank is lost."""
GRACE_S = 5.0
"""After a rank is found lost, the main thread has this long to fail on its own before the process exits."""
_LOST = "lost"


_UNCAUGHT: list[BaseException] = []
"""Uncaught exceptions of this process's main thread (seen by the hook :func:`note_uncaught_exceptions` chains)."""


def note_uncaught_exceptions() -> None:
    """Chain ``sys.excepthook`` (once) so that :func:`ended_by_exception` can tell an exit hook why the process ends."""
    previous_hook = sys.excepthook
    if getattr(previous_hook, "_angelptm_notes", False):
        return

    def note(*exc_info: Any) -> None:
        _UNCAUGHT.append(exc_info[1])
        previous_hook(*exc_info)

    note._angelptm_notes = True
    sys.excepthook = note


def ended_by_exception() -> bool:
    """Whether an uncaught exception is ending this process (in an ``atexit`` hook; needs
    :func:`note_uncaught_exceptions` first)."""
    return bool(_UNCAUGHT)


class RankLostError(RuntimeError):
    """Another rank of the job is gone; the message names it."""


class RankWatchdog:
    """This rank's heartbeat, and its watch over the next rank's.

    Args:
        store: the job's rendezvous store (``torch.distributed.rendezvous``).
        rank: this rank.
        world_size: ranks in the job.
        lost_after_s: a heartbeat standing still this long means its rank is lost.
    """

    def __init__(self, store: Any, rank: int, world_size: int, lost_after_s: float) -> None:
        self._store = dist.PrefixStore("angelptm/liveness/", store)
        self.rank, self.world_size, self.lost_after_s = rank, world_size, lost_after_s
        self.interval_s = max(lost_after_s / 10, 0.1)
        self.lost: str | None = None
        """Why the job is over (a lost rank), once known."""
        self._stopped = threading.Event()
        self._store.add(f"beat/{rank}", 1)
        self._thread = threading.Thread(target=self._run, name="angelptm-heartbeat", daemon=True)
        self._thread.start()
        note_uncaught_exceptions()
        atexit.register(lambda: self.stop(done=not ended_by_exception()))

    def stop(self, *, done: bool = True) -> None:
        """End the heartbeat; ``done``: this rank finished its work (its watcher must not report it lost)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if done:
            try:
                self._store.set(f"done/{self.rank}", "1")
            except Exception:  # the store's host left first: nobody is left to watch us
                pass
        self._thread.join(timeout=2 * self.interval_s + 1)

    def explain(self, error: BaseException) -> RankLostError | None:
        """After a collective failed: which ranks stopped beating (waits up to three beats to see).

        Returns:
            An error naming the lost ranks, or None when every rank still beats (the failure is something else).
        """
        if self.lost is not None:
            return RankLostError(f"{self.lost} ({_first_line(error)})")
        try:
            before = self._counters()
            time.sleep(3 * self.interval_s)
            after = self._counters()
            lost = [r for r in range(self.world_size)
                    if r != self.rank and after[r] == before[r] and not self._done(r)]
        except Exception as err:  # the store itself is gone, and with it the rank or agent that hosted it
            return RankLostError(f"the job's rendezvous store stopped answering ({_first_line(err)}): the process "
                                 f"hosting it (rank 0, or torchrun's agent) is gone ({_first_line(error)})")
        if not lost:
            return None
        return RankLostError(f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of {self.world_size} "
                             f"stopped (no heartbeat for {3 * self.interval_s:.1f} s) and a collective with "
                             f"{'them' if len(lost) > 1 else 'it'} failed: {_first_line(error)}")

    def _counters(self) -> list[int]:
        return [self._store.add(f"beat/{r}", 0) for r in range(self.world_size)]

    def _done(self, rank: int) -> bool:
        return self._store.check([f"done/{rank}"])

    def _run(self) -> None:
        watched = (self.rank + 1) % self.world_size
        last_value, last_change, store_down_since = -1, time.monotonic(), None
        while not self._stopped.wait(self.interval_s):
            try:
                self._store.add(f"beat/{self.rank}", 1)
                if self._store.check([_LOST]):
                    return self._give_up(self._store.get(_LOST).decode())
                value, store_down_since = self._store.add(f"beat/{watched}", 0), None
            except Exception as err:  # tolerated for a while: at a normal end the store's host may leave first
                now = time.monotonic()
                store_down_since = store_down_since or now
                if now - store_down_since >= self.lost_after_s:
                    silent_s = now - store_down_since
                    return self._give_up(f"the job's rendezvous store has not answered for {silent_s:.0f} s "
                                         f"({_first_line(err)}): the process hosting it (rank 0, or torchrun's "
                                         "agent) is gone")
                continue
            now = time.monotonic()
            if value != last_value:
                last_value, last_change = value, now
            elif now - last_change >= self.lost_after_s and not self._done(watched):
                reason = (f"rank {watched} of {self.world_size} is lost: no heartbeat for {now - last_change:.0f} s "
                          f"(comms.lost_rank_after_s={self.lost_after_s:g})")
                try:
                    self._store.compare_set(_LOST, "", reason)  # the first watcher's verdict stands
                except Exception:
                    pass
                return self._give_up(reason)

    def _give_up(self, reason: str) -> None:
        self.lost = reason
        logger.error("%s; rank %d stops", reason, self.rank)
        if self._stopped.wait(GRACE_S):
            return  # the main thread failed on its own, reported it and left
        sys.stderr.write(f"error: {reason}; rank {self.rank} exits (status {EXIT_CODE})\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
