"""Run health for ``pretrain.py``: stop a run that no longer trains, and never prune its last good checkpoint.

A corrupted or diverged run (NaN weights, an lr of 1e10) once went on for 276 steps, each skipped as an
"overflow", ended "done: final loss nan" with exit status 0, and ``keep_last`` pruned every checkpoint from
before the damage. A step is healthy when it was applied (not skipped for overflow) and its loss is finite;
after ``train.max_bad_steps`` consecutive unhealthy steps the run stops with
:class:`~angelptm.pretraining.job_errors.RunUnhealthyError`, naming the last healthy checkpoint, and
``latest`` is pointed back at it. Each checkpoint ``pretrain.py`` saves records whether the run was healthy
then (``client_state["healthy"]``), and pruning always keeps the newest healthy one.

A user's own script keeps DeepSpeed's behaviour (skipped steps go on): its engine calls :meth:`RunHealth.watch`,
which never raises and returns one warning line when the run turns unhealthy and one info line when it recovers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from angelptm.checkpoints import files as checkpoint
from angelptm.errors import CheckpointError
from angelptm.pretraining.job_errors import RunUnhealthyError

logger = logging.getLogger("pretrain")

HEALTHY_KEY = "healthy"
"""``client_state`` key of a checkpoint saved by ``pretrain.py``: whether its last step was healthy."""


@dataclass(slots=True)
class RunHealth:
    """Consecutive unhealthy steps, and the cause of the latest one."""

    max_bad_steps: int
    bad_steps: int = 0
    last_cause: str = ""

    @property
    def healthy(self) -> bool:
        return self.bad_steps == 0

    def record(self, step: int, *, applied: bool, finite: bool) -> None:
        """Count one optimizer step (``finite``: every micro-batch loss on every rank); raise when
        ``max_bad_steps`` in a row were unhealthy.

        Raises:
            RunUnhealthyError: naming the cause; the caller adds the last healthy checkpoint.
        """
        if applied and finite:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        self.last_cause = ("the loss is not finite" if not finite else
                           "the step was skipped (non-finite gradients: overflow)")
        if self.bad_steps >= self.max_bad_steps:
            raise RunUnhealthyError(f"no healthy step in the last {self.bad_steps} steps (up to step {step}; "
                                    f"train.max_bad_steps {self.max_bad_steps}): {self.last_cause}")

    def watch(self, step: int, *, applied: bool, finite: bool) -> tuple[int, str] | None:
        """Like :meth:`record` but never raises: a user's own script goes on as under DeepSpeed.

        Returns:
            (logging level, line) at the step the run turns unhealthy (the ``max_bad_steps``-th bad step in a
            row) and at the first healthy step after that; None at every other step.
        """
        was_unhealthy, bad_before = self.bad_steps >= self.max_bad_steps, self.bad_steps
        try:
            self.record(step, applied=applied, finite=finite)
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


def stop_unhealthy(err: RunUnhealthyError, save_dir: str) -> RunUnhealthyError:
    """``err`` completed with the last healthy checkpoint, which ``latest`` names again (rank 0 calls it)."""
    root = Path(save_dir)
    steps = sorted((step, p) for p in root.glob("global_step*") if p.is_dir()
                   and (step := step_of(p.name)) is not None)
    healthy = newest_healthy([p for _, p in steps])
    if healthy is None:
        where = (f"no healthy checkpoint in {save_dir}; start again (pretrain.py --save-dir NEW_DIR) with a lower "
                 "optimizer.params.lr")
    else:
        checkpoint.point_latest(root, healthy.name)
        where = (f"the last healthy checkpoint is {healthy} and `latest` names it again (the later ones are kept for "
                 "inspection); lower optimizer.params.lr, check the data and the NVMe drive, then rerun to resume "
                 "from it")
    return RunUnhealthyError(f"{err}; {where}")


def step_of(tag: str) -> int | None:
    """N for a ``global_stepN`` tag, else None."""
    digits = tag.removeprefix("global_step")
    return int(digits) if digits != tag and digits.isdigit() else None
