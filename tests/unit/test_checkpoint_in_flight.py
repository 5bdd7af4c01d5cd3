"""The one save a training loop has in flight (angelptm.checkpoints.background.InFlightSave): a wait cut short keeps
it, a wait seen through lets it go, and its error is raised once."""

from __future__ import annotations

from pathlib import Path

import pytest

from angelptm.checkpoints.background import InFlightSave


class FakeSave:
    """What InFlightSave reads of a PendingSave: a writer still going, whose wait is interrupted the first time."""

    def __init__(self, path: Path, outcomes: list) -> None:
        self.path, self.outcomes, self.over, self.waits = path, outcomes, False, 0

    def done(self) -> bool:
        return False

    def wait(self) -> Path:
        self.waits += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, KeyboardInterrupt):
            raise outcome  # (cut short: the save is not over)
        self.over = True
        if isinstance(outcome, Exception):
            raise outcome
        return self.path


def test_a_wait_cut_short_keeps_the_save_for_the_next_wait(tmp_path):
    in_flight = InFlightSave()
    save = FakeSave(tmp_path / "global_step3", [KeyboardInterrupt(), "published"])
    in_flight._pending = save  # (held: its writer is going on)
    with pytest.raises(KeyboardInterrupt):
        in_flight.wait()
    assert in_flight._pending is save, "an interrupted wait forgot the save its writer is still writing"
    assert in_flight.wait() == tmp_path / "global_step3"
    assert in_flight.wait() is None and save.waits == 2


def test_a_failed_save_raises_once_then_is_let_go(tmp_path):
    in_flight = InFlightSave()
    in_flight._pending = FakeSave(tmp_path / "global_step3", [OSError("disk gone")])
    with pytest.raises(OSError, match="disk gone"):
        in_flight.wait()
    assert in_flight.wait() is None
