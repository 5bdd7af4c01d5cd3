"""Run health for ``pretrain.py``: stop a run that no longer trains, and never prune its last good checkpoint.

A corrupted or diverged run (NaN weights, an lr of 1e10) once went on for 276 steps, each skipped as an
"overflow", ended "done: final loss nan" with exit status 0, and ``keep_last`` pruned every checkpoint from
before the damage. A step is healthy when it was applied (not skipped for overflow) and its loss is finite;
after ``train.max_bad_steps`` consecutive unhealthy steps the run stops with
:class:`~angelptm.pretraining.job_errors.RunUnhealthyError`, naming the last healthy checkpoint, and
``latest`` is pointed back at it. Each checkpoint ``pretrain.py`` saves records whether the run was healthy
then (``client_state["healthy"]``), and pruning always keeps the newest healthy one.

A run shorter than ``max_bad_steps`` that ends with a non-finite loss (NaN from the fourth step, say) is diverged
all the same: it ends with the same error and exit status (:meth:`RunHealth.ended_diverged`), and ``latest`` is
never moved onto a checkpoint saved after a non-finite loss (nor left on the one saved just before it, whose
weights gave that loss: :attr:`RunHealth.last_trusted_step`). When no checkpoint is trusted, ``latest`` is renamed
``latest.untrusted`` and a rerun refuses to start rather than diverge again, in a loop; without ``latest``, a rerun
never falls back to a checkpoint saved unhealthy (:func:`resume_point`). The fp16 loss scaler's search for a scale
(every overflow halves it) is not divergence: those skipped steps are not counted, and the scaler itself stops a
run whose gradients overflow at its minimum scale.

A user's own script keeps DeepSpeed's behaviour (skipped steps go on): its engine calls :meth:`RunHealth.watch`,
which never raises and returns one warning line when the run turns unhealthy and one info line when it recovers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import paths
from angelptm.checkpoints.paths import LATEST, LATEST_UNTRUSTED
from angelptm.checkpoints.selection import saved_checkpoints
from angelptm.errors import CheckpointError
from angelptm.launch.distributed import DistContext
from angelptm.pretraining.job_errors import RunUnhealthyError

logger = logging.getLogger("pretrain")

HEALTHY_KEY = "healthy"
"""``client_state`` key of a checkpoint saved by ``pretrain.py``: whether its last step was healthy."""


@dataclass(frozen=True, slots=True)
class RunEnd:
    """How a training loop that did not fail ended."""

    step: int
    """The last step it ran."""
    loss: float
    """The loss on the step line of ``step`` (the mean over the steps since the line before it)."""
    interrupted: bool
    """Ctrl-C or SIGTERM stopped it before ``train.steps``."""


@dataclass(slots=True)
class RunHealth:
    """Consecutive unhealthy steps, and the cause of the latest one."""

    max_bad_steps: int
    bad_steps: int = 0
    last_cause: str = ""
    first_bad_step: int | None = None
    """The first step of the current run of unhealthy steps (None while healthy)."""
    diverged: bool = False
    """A step of the current unhealthy run had a non-finite loss: the weights no longer train (a skipped step with
    a finite loss may be an overflow the run recovers from)."""

    @property
    def healthy(self) -> bool:
        return self.bad_steps == 0

    @property
    def last_trusted_step(self) -> int | None:
        """The newest step whose checkpoint may be resumed from (None while healthy: any).

        A step's loss is computed with the weights of the step before it, so the checkpoint saved just before
        the first non-finite loss holds the weights that gave it (a loss of NaN at step N comes from the weights
        saved at step N - 1); after a diverged run that one is not trusted either.
        """
        if self.first_bad_step is None:
            return None
        return self.first_bad_step - (2 if self.diverged else 1)

    def record(self, step: int, *, applied: bool, finite: bool, scale_search: bool = False) -> None:
        """Count one optimizer step (``finite``: every micro-batch loss on every rank); raise when
        ``max_bad_steps`` in a row were unhealthy.

        ``scale_search``: the step was skipped by a dynamic fp16 loss scaler, which halves its scale at each
        overflow until the gradients fit (``fp16.initial_scale_power: 40`` takes 25 such steps). That is the
        scaler working, not the run diverging: such a step changes nothing here (the scaler itself stops the
        run when its scale reaches ``fp16.min_loss_scale``). A step with a non-finite loss always counts.

        Raises:
            RunUnhealthyError: naming the cause; the caller adds the last healthy checkpoint.
        """
        if applied and finite:
            self.bad_steps, self.first_bad_step, self.diverged = 0, None, False
            return
        if scale_search and finite:
            return
        if self.bad_steps == 0:
            self.first_bad_step = step
        self.bad_steps += 1
        self.diverged = self.diverged or not finite
        self.last_cause = ("the loss is not finite" if not finite else
                           "the step was skipped (non-finite gradients: overflow)")
        if self.bad_steps >= self.max_bad_steps:
            raise RunUnhealthyError(f"no healthy step in the last {self.bad_steps} steps (up to step {step}; "
                                    f"train.max_bad_steps {self.max_bad_steps}): {self.last_cause}")

    def ended_diverged(self, step: int) -> RunUnhealthyError | None:
        """The error for a run that ends (its last step, or a stop request) with a non-finite loss in its current
        unhealthy run, however short: it must not end "done" with exit status 0. None when it did not."""
        if not self.diverged:
            return None
        return RunUnhealthyError(f"the run ended at step {step} with a non-finite loss: it diverged at step "
                                 f"{self.first_bad_step} ({self.bad_steps} unhealthy step(s) since, too few for "
                                 f"train.max_bad_steps {self.max_bad_steps} to stop it earlier)")

    def watch(self, step: int, *, applied: bool, finite: bool, scale_search: bool = False) -> tuple[int, str] | None:
        """Like :meth:`record` but never raises: a user's own script goes on as under DeepSpeed.

        Returns:
            (logging level, line) at the step the run turns unhealthy (the ``max_bad_steps``-th bad step in a
            row) and at the first healthy step after that; None at every other step.
        """
        was_unhealthy, bad_before = self.bad_steps >= self.max_bad_steps, self.bad_steps
        try:
            self.record(step, applied=applied, finite=finite, scale_search=scale_search)
        except RunUnhealthyError as err:
            return None if was_unhealthy else (logging.WARNING, (
                f"{err}; lower optimizer.params.lr or check the data (engine.was_step_applied() tells whether "
                "each step was applied)"))
        if was_unhealthy and self.healthy:
            return logging.INFO, f"the run is healthy again at step {step} after {bad_before} unhealthy steps"
        return None


def checkpoint_is_healthy(path: Path) -> bool:
    """Whether a checkpoint was saved while the run was healthy (one not saved by pretrain.py counts as healthy)."""
    try:
        client_state = checkpoint.load_file(path / checkpoint.MODEL_FILE).get("client_state") or {}
    except CheckpointError:
        return False
    return bool(client_state.get(HEALTHY_KEY, True))


def newest_healthy(paths_oldest_first: list[Path]) -> Path | None:
    """The newest of these checkpoint directories that was saved healthy."""
    return next((path for path in reversed(paths_oldest_first) if checkpoint_is_healthy(path)), None)


def stop_unhealthy(err: RunUnhealthyError, save_dir: str, run_health: RunHealth | None = None) -> RunUnhealthyError:
    """``err`` completed with the last healthy checkpoint, which ``latest`` names again (rank 0 calls it).

    Args:
        run_health: the run's; checkpoints after its :attr:`RunHealth.last_trusted_step` are not candidates.
    """
    root = Path(save_dir)
    last_trusted_step = run_health.last_trusted_step if run_health is not None else None
    steps = sorted((step, p) for p in root.glob("global_step*") if p.is_dir() and paths.is_inside(root, p)
                   and (step := step_of(p.name)) is not None
                   and (last_trusted_step is None or step <= last_trusted_step))
    healthy = newest_healthy([p for _, p in steps])
    if healthy is None:
        where = (f"no healthy checkpoint in {save_dir}{_set_latest_aside(root)}; start again (pretrain.py "
                 "--save-dir NEW_DIR) with a lower optimizer.params.lr")
    else:
        checkpoint.point_latest(root, healthy.name)
        why = (f"; the one of step {last_trusted_step + 1} holds the weights that gave the first non-finite loss"
               if run_health is not None and run_health.diverged else "")
        where = (f"the last healthy checkpoint is {healthy} and `latest` names it again (the later ones are kept for "
                 f"inspection{why}); lower optimizer.params.lr, check the data and the NVMe drive, then rerun to "
                 "resume from it")
    return RunUnhealthyError(f"{err}; {where}")


def _set_latest_aside(root: Path) -> str:
    """Rename ``latest`` to ``latest.untrusted`` (the run trusts no checkpoint: a rerun resuming the one it names
    would diverge again, in a loop); returns what to add to the error about it.

    ``os.replace`` within one directory (opened once, both names relative to it) is atomic and moves the entry
    ``latest`` itself, never what a symlink there leads to; what it held is read with ``read_latest``
    (``O_NOFOLLOW``, size-capped) for the message only.
    """
    if not os.path.lexists(root / LATEST):
        return ""
    tag, _ = paths.read_latest(root)
    named = f"named {tag}" if tag is not None else "was damaged"
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.replace(LATEST, LATEST_UNTRUSTED, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as err:
        return (f" ({LATEST} {named} and could not be moved aside: {err.strerror or err}; delete {root / LATEST} "
                "before a rerun, or it resumes the weights that diverged)")
    return (f" ({LATEST} {named}, whose weights are not trusted; it is moved aside to {root / LATEST_UNTRUSTED} so "
            "that a rerun does not resume them)")


def unhealthy_mark(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not resumed without ``latest`` naming it: it was saved while the run was
    unhealthy (``client_state["healthy"]`` False, e.g. kept for inspection after a non-finite loss); None when it
    is not so marked (or cannot be read: the load reports that)."""
    try:
        client_state = checkpoint.load_file(path / checkpoint.MODEL_FILE).get("client_state") or {}
    except CheckpointError:
        return None
    if client_state.get(HEALTHY_KEY, True):
        return None
    return f"was saved while the run was unhealthy (client_state {HEALTHY_KEY}=False)"


def resume_point(save_dir: str, ctx: DistContext) -> Path | None:
    """The checkpoint a job that resumes on its own goes on from (every rank calls it): the one ``latest`` names
    if it verifies, else the newest older one that does; without ``latest``, the newest that verifies and was not
    saved unhealthy. None when ``save_dir`` holds no checkpoint.

    Raises:
        CheckpointError: no ``latest`` but a ``latest.untrusted`` (the last run trusted none of its checkpoints),
            or only damaged checkpoints and ones saved unhealthy (each is named).
    """
    root = Path(save_dir)
    if ctx.any_rank(os.path.lexists(root / LATEST)):
        return checkpoint.resolve(save_dir, None, ctx)
    if not ctx.any_rank(bool(saved_checkpoints(root))):
        return None
    if ctx.any_rank(os.path.lexists(root / LATEST_UNTRUSTED)):
        raise CheckpointError(
            f"{root} has no {LATEST} but a {LATEST_UNTRUSTED}: the run that saved there stopped unhealthy and "
            f"trusted none of its checkpoints, so resuming would diverge again. Start again (pretrain.py --save-dir "
            f"NEW_DIR) with a lower optimizer.params.lr; to resume the one it names anyway, rename "
            f"{root / LATEST_UNTRUSTED} back to {LATEST}")
    return checkpoint.resolve(save_dir, None, ctx, fall_back_without_latest=True, untrusted=unhealthy_mark)


def step_of(tag: str) -> int | None:
    """N for a ``global_stepN`` tag, else None."""
    digits = tag.removeprefix("global_step")
    return int(digits) if digits != tag and digits.isdigit() else None
