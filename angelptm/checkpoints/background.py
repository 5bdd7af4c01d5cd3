"""A checkpoint of ZeRO-Cache's states streamed to disk through a few staging buffers, beside training or not.

:func:`save_streamed` writes the files :func:`angelptm.checkpoints.files.save` writes, with the same protocol (a
temporary directory, every file fsynced and hashed into the manifest, the rename, ``latest`` replaced last), but
the optimizer's states come from a :class:`~zero_cache.StateSnapshot`: staged a few chunks at a time and written
record by record (:mod:`angelptm.checkpoints.streamed`), so the host holds at most ``max_staged`` chunks of them
whatever the model's size.

A **writer thread** writes; the calling thread stages (the snapshot's docstring says why). :meth:`PendingSave.wait`
stages what is left, waits for the writer and returns the checkpoint's path, or raises what went wrong. A save that
goes on beside training (``background``; one process: the end of a save is a collective across ranks, which the
writer thread must not issue beside the training thread's) returns after staging what fits in the buffers; the
writer then also publishes the checkpoint (the manifest, the rename, ``latest``), so ``latest`` moves only once
every file is complete and fsynced, and never after a failure (the temporary directory is removed). Each chunk
not yet staged is staged before the next step first modifies it (copy-on-write), so the files hold the states of
the step at which the save was called. The engine waits for a pending save at the next save, at a load, at
``destroy()``, and at the interpreter's exit (``atexit``; also after a Ctrl-C interrupted a wait), and raises a
failed one's error at the next save, step or ``destroy()``; :class:`InFlightSave` is that bookkeeping, for the engine
and for AutoPipe's training loop alike.

A save with **no snapshot** (AutoPipe's stages: plain tensors, no ZeRO-Cache chunks) goes through the same writer:
in the background every tensor is copied to host memory while the save is planned, before it returns (a whole
copy of the rank's states, the price of not pausing training for the disk), so the next step may change them.
"""

from __future__ import annotations

import atexit
import logging
import threading
from pathlib import Path
from typing import Any, Callable

from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import streamed
from angelptm.launch.distributed import DistContext
from zero_cache import StateSnapshot

logger = logging.getLogger(__name__)


class PendingSave:
    """One streamed save: its writer thread, and what it ended with.

    Args:
        target: where it writes (:func:`~angelptm.checkpoints.files.prepare_save`).
        ctx: this rank's place in the world.
        plans: file -> its planned archive.
        snapshot: the states the archives' refs are read from (None: the archives hold no refs).
        save_latest: point ``latest`` at it.
        publish_in_writer: the writer thread publishes it (a single process); else :meth:`wait` does.
        on_end: called once the save is over, however it ended (the optimizer forgets the snapshot).
    """

    def __init__(self, target: checkpoint.SaveTarget, ctx: DistContext, plans: dict[Path, streamed.ArchivePlan],
                 snapshot: StateSnapshot | None, *, save_latest: bool, publish_in_writer: bool,
                 on_end: Callable[[], None]) -> None:
        self.target, self.ctx, self.plans, self.snapshot = target, ctx, plans, snapshot
        self.save_latest, self.publish_in_writer, self._on_end = save_latest, publish_in_writer, on_end
        self._records: list[Any] = []
        self._error: BaseException | None = None
        self._path: Path | None = None
        self._over = False
        self._thread = threading.Thread(target=self._write, name=f"checkpoint-writer-{target.tag}", daemon=True)

    def start(self) -> PendingSave:
        atexit.register(self._finish_at_exit)
        self._thread.start()
        return self

    @property
    def tag(self) -> str:
        return self.target.tag

    def _write(self) -> None:
        try:
            self._records = streamed.write_archives(self.plans, self.snapshot)
        except BaseException as err:  # (reported by wait(); the training thread must stop waiting for buffers)
            self._error = err
            self._abort_snapshot()
        if self.publish_in_writer:
            self._publish()

    def _publish(self) -> None:
        try:
            self._path = checkpoint.publish_save(self.target, self.ctx, self._records, self._error,
                                                 payload=list(self.plans.values()), save_latest=self.save_latest)
            self._error = None
        except BaseException as err:  # the temporary directory is gone and latest untouched
            self._error = err
        finally:
            self._abort_snapshot()  # (nothing is left to stage; frees the buffers)
            self._on_end()

    def _abort_snapshot(self) -> None:
        if self.snapshot is not None:
            self.snapshot.abort()

    def pump(self) -> None:
        """Stage what fits in the free buffers (at the engine's calls, so the writer keeps busy)."""
        if self.snapshot is not None and not self.snapshot.finished():
            self.snapshot.pump()

    def failed(self) -> bool:
        """Whether the writer has stopped with an error (:meth:`wait` raises it)."""
        return not self._thread.is_alive() and self._error is not None

    def done(self) -> bool:
        """Whether the writer has finished (published, or failed)."""
        return not self._thread.is_alive()

    @property
    def over(self) -> bool:
        """Whether :meth:`wait` has seen the save through (published, or its failure published), not cut short."""
        return self._over

    def wait(self) -> Path:
        """Stage what is left, wait for the writer, and publish the checkpoint if the writer does not.

        Returns:
            The checkpoint directory.

        Raises:
            The save's error (an ``OSError`` naming the file, a ``DiskFullError``, a ``CheckpointError``); the
            previous checkpoint and ``latest`` are then untouched.
        """
        if not self._over:
            staging_error = None
            try:
                if self.snapshot is not None:
                    self.snapshot.stage_all()
            except Exception as err:  # the writer cannot finish: stop it, and publish the failure all the same, which
                staging_error = err  # removes the temporary directory (and, with several ranks, tells the others)
                self.snapshot.abort()
            self._thread.join()
            if staging_error is not None:
                self._error = staging_error  # (the cause, not the writer's SnapshotAborted)
            if not self.publish_in_writer:
                self._publish()
            self._over = True
            atexit.unregister(self._finish_at_exit)
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path

    def _finish_at_exit(self) -> None:
        """At the interpreter's exit: finish the save (a script that ends right after ``save_checkpoint``)."""
        if not self._over:  # (it can take a while: say why the process has not ended yet)
            logger.warning("finishing the checkpoint %s before the process exits: it was still being written", self.tag)
        try:
            self.wait()
        except BaseException as err:  # (nothing is left to raise it to)
            logger.error("the checkpoint %s being written at exit failed (latest still names the previous one): %s",
                         self.tag, err)


def save_streamed(save_dir: str, tag: str, ctx: DistContext, *, shared: dict[str, Any], per_rank: Any,
                  snapshot: StateSnapshot | None, save_latest: bool, background: bool,
                  on_end: Callable[[], None] = lambda: None) -> PendingSave:
    """Start a checkpoint whose files hold :class:`~zero_cache.StateRef` placeholders read from ``snapshot``.

    Args:
        save_dir, tag, ctx, shared, per_rank, save_latest: as :func:`angelptm.checkpoints.files.save`'s
            (``shared`` a dict, written by rank 0).
        snapshot: the optimizer's snapshot, begun for this save; None when ``shared`` and ``per_rank`` hold no
            :class:`~zero_cache.StateRef` (with ``background`` their tensors are copied before this returns).
        background: go on beside training (one process only); else the caller waits at once.
        on_end: called when the save is over (the snapshot is then forgotten).

    Returns:
        The save in progress (``background``) or already published: :meth:`PendingSave.wait` gives its path.

    Raises:
        CheckpointError: the directory cannot be prepared, or a file would hold objects loading refuses (before
            anything is written; every rank raises).
    """
    try:
        target = checkpoint.prepare_save(save_dir, tag, ctx)
    except BaseException:
        if snapshot is not None:
            snapshot.abort()
        on_end()
        raise
    plans: dict[Path, streamed.ArchivePlan] = {}
    error: BaseException | None = None
    try:
        files = {**(shared if ctx.is_main else {}), checkpoint.rank_file(ctx.rank): per_rank}
        for name, obj in files.items():
            plans[target.tmp / name] = streamed.plan_archive(obj, target.tmp / name, copy_tensors=background)
    except Exception as err:  # (every rank must learn of it: publish_save tells them)
        error = err
    if error is not None:
        if snapshot is not None:
            snapshot.abort()
        try:
            checkpoint.publish_save(target, ctx, [], error, payload=None, save_latest=save_latest)
        finally:
            on_end()
    alone = ctx.group is None
    pending = PendingSave(target, ctx, plans, snapshot, save_latest=save_latest,
                          publish_in_writer=alone and background, on_end=on_end).start()
    if background and alone:
        pending.pump()
    else:
        pending.wait()
    return pending


class InFlightSave:
    """The checkpoint a training loop has being written beside it (at most one), and the guarantees around it: the
    engine's (:meth:`angelptm.Engine.save_checkpoint` with ``background``) and AutoPipe's training loop's
    (:mod:`angelptm.pretraining.pipeline_parallel`) are this one object, so both wait and report alike."""

    def __init__(self) -> None:
        self._pending: PendingSave | None = None

    def hold(self, pending: PendingSave) -> Path:
        """Keep ``pending`` while its writer goes on (a save already over is waited for, and its error raised).

        Returns:
            The checkpoint directory (where it will be, while it is still being written).
        """
        assert self._pending is None, "a save started before the previous one was waited for"
        if pending.done():
            return pending.wait()
        self._pending = pending
        return pending.target.final

    def wait(self) -> Path | None:
        """Wait for the save still being written, if any: before the next save, a load, a stop.

        Returns:
            Its directory, or None when none was being written.

        Raises:
            Its error (the previous checkpoint and ``latest`` are then untouched), once.
        """
        pending = self._pending
        if pending is None:
            return None
        try:
            return pending.wait()
        finally:
            if pending.over:  # (a wait cut short, by Ctrl-C say, leaves the save here for the next wait to finish)
                self._pending = None

    @property
    def writing(self) -> bool:
        """Whether its writer has not finished (``latest`` may not name it yet)."""
        return self._pending is not None and not self._pending.done()

    def goes_on(self, *, report: bool = False) -> None:
        """Between steps: stage what fits in its free buffers; with ``report`` (before a step), raise a failed
        save's error (once; the save is then over)."""
        pending = self._pending
        if pending is None:
            return
        if report and pending.failed():
            self.wait()
        pending.pump()


def settle_before_stop(wait: Callable[[], object]) -> None:
    """Finish the save in the background before a run stops on an error of its own (its writer would otherwise move
    ``latest`` after the stop pointed it back at the last healthy checkpoint); the save's own failure is logged, not
    raised: the run's error is the one to report."""
    try:
        wait()
    except Exception as err:
        logger.error("the checkpoint being written when the run stopped failed (latest is untouched by it): %s", err)
