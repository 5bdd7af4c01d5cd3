"""The host worker's job queue (two FIFO lanes, gradients before updates) and the loop of its one thread.

Gradient jobs (adding a staged micro-batch gradient into a host fp32 accumulator) are short, and
``step()`` needs all of them done to know the global norm; update jobs (CPU Adam over a chunk) are
long. With one lane, the norm would wait behind every update queued during the last backward. So
the worker takes the oldest gradient job whenever there is one, and ``drain(GRADIENTS)`` waits for
that lane alone. No update depends on a gradient job queued after it: a chunk's accumulation is
queued before its update, and the training thread waits for a chunk's update before it stages that
chunk's next gradient (``ZeroCacheOptimizer.wait_for_chunk``).

Updates of different chunks do not depend on each other, so the updates lane may be re-sorted
(:meth:`JobQueue.reorder`): backward queues them last chunk first, the next forward wants them
first chunk first. (Whether a speculative update is applied or deferred depends on the updates
queued before it, not on which the worker ran first: :class:`zero_cache.optim.revision.SpeculationWindow`.)
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable

GRADIENTS, UPDATES = "gradients", "updates"
STOP = object()
"""The job that ends :func:`serve`."""


class JobQueue:
    """Two lanes of jobs for one consumer thread, with ``join`` per lane or for both."""

    def __init__(self) -> None:
        self._lanes: dict[str, collections.deque] = {GRADIENTS: collections.deque(), UPDATES: collections.deque()}
        self._unfinished = dict.fromkeys(self._lanes, 0)
        self._lane_of: dict[int, str] = {}  # id(job) -> its lane, from get() until task_done()
        self._changed = threading.Condition()

    def put(self, job: Any, lane: str = UPDATES) -> None:
        with self._changed:
            self._lanes[lane].append(job)
            self._unfinished[lane] += 1
            self._changed.notify_all()

    def get(self, block: bool = True) -> Any:
        """The oldest gradient job, else the oldest update; None when empty and not ``block``."""
        with self._changed:
            while not any(self._lanes.values()):
                if not block:
                    return None
                self._changed.wait()
            lane = GRADIENTS if self._lanes[GRADIENTS] else UPDATES
            job = self._lanes[lane].popleft()
            self._lane_of[id(job)] = lane
            return job

    def task_done(self, job: Any) -> None:
        with self._changed:
            self._unfinished[self._lane_of.pop(id(job))] -= 1
            self._changed.notify_all()

    def reorder(self, key: Callable[[Any], int | None], lane: str = UPDATES) -> None:
        """Sort the jobs still waiting in ``lane`` by ``key``, stably; a job whose key is None is a barrier that
        nothing crosses (the jobs before it stay before it)."""
        with self._changed:
            jobs, ordered, run = self._lanes[lane], [], []
            for job in jobs:
                if key(job) is None:
                    ordered += sorted(run, key=key) + [job]
                    run = []
                else:
                    run.append(job)
            jobs.clear()
            jobs.extend(ordered + sorted(run, key=key))

    def join(self, lane: str | None = None) -> None:
        """Block until every job of ``lane`` (None: of both) put so far has been marked done."""
        lanes = (lane,) if lane is not None else tuple(self._lanes)
        with self._changed:
            while any(self._unfinished[name] for name in lanes):
                self._changed.wait()


def serve(jobs: JobQueue, worker_ref: weakref.ref) -> None:
    """The worker thread's loop: run jobs in order, starting the next job's transfer (``start_job``) before running
    the current one (``run_job``), until :func:`stop` or until the worker object is gone."""
    ahead = None  # (job, what its start returned): the next job, its transfer already started
    while True:
        if ahead is None:
            job = jobs.get()  # blocks holding no reference to the worker
            worker = worker_ref()
            current = (job, None) if job is STOP or worker is None else worker.start_job(job)
        else:
            current, ahead, worker = ahead, None, worker_ref()
        if current[0] is STOP or worker is None:
            jobs.task_done(current[0])
            return
        following = jobs.get(block=False)
        if following is not None:
            ahead = (following, None) if following is STOP else worker.start_job(following)
        worker.run_job(*current)
        jobs.task_done(current[0])
        # Hold nothing of the optimizer while blocked: a job (a closure over the optimizer) left in a
        # local would keep it, its pinned memory and its swap file alive after the engine is dropped.
        worker = current = job = following = None


def stop(jobs: JobQueue, thread: threading.Thread) -> None:
    """End :func:`serve` once the updates queued before have run (gradient jobs always run first), and wait for the
    thread (unless it is this one)."""
    jobs.put(STOP)
    if thread is not threading.current_thread():
        thread.join()
