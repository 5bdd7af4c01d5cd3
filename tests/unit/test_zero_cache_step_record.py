"""The chunk step records: the transitions the update path makes are allowed, the others raise, and what is in
flight outlives the window until it is waited for."""

import threading

import pytest

from zero_cache.optim.host_update import ChunkUpdate
from zero_cache.optim.step_record import ChunkSteps, Phase, StepTransitionError


def update(chunk: int, **kwargs) -> ChunkUpdate:
    return ChunkUpdate(chunk=chunk, members={}, hypers=[], step=1, **kwargs)


def test_a_speculated_chunk_is_revised_and_the_window_starts_it_again():
    steps = ChunkSteps(4)
    speculative = update(2)
    steps.speculate(speculative)
    assert steps[2].phase is Phase.SPECULATED and steps.speculated() == {2: speculative}
    revision = update(2, revises=speculative)
    steps.revise(revision)
    assert steps[2].phase is Phase.REVISED and steps.speculated() == {2: speculative}
    assert steps.in_flight() == [2]
    steps.new_window()
    assert steps[2].phase is Phase.WAITING_GRADIENT and steps.speculated() == {}
    assert steps.take_waits(2) == (None, revision), "the revision stays to be waited for after the window"
    assert steps.take_waits(2) == (None, None) and steps.in_flight() == []


@pytest.mark.parametrize("illegal", ["speculate twice", "revise unspeculated", "queue speculated",
                                     "device step queued", "restore speculated"])
def test_transitions_the_step_never_makes_raise(illegal):
    steps = ChunkSteps(2)
    if illegal == "speculate twice":
        steps.speculate(update(1))
        with pytest.raises(StepTransitionError, match="SPECULATED to SPECULATED"):
            steps.speculate(update(1))
    elif illegal == "revise unspeculated":
        with pytest.raises(StepTransitionError, match="WAITING_GRADIENT to REVISED"):
            steps.revise(update(1))
    elif illegal == "queue speculated":
        steps.speculate(update(1))
        with pytest.raises(StepTransitionError, match="SPECULATED to QUEUED"):
            steps.queue(update(1))
    elif illegal == "device step queued":
        steps.queue(update(1))
        with pytest.raises(StepTransitionError, match="QUEUED to DEVICE_STEPPED"):
            steps.on_device(1, None)
    else:
        steps.speculate(update(1))
        with pytest.raises(StepTransitionError, match="restored"):
            steps.restore(update(1, restore_only=True))


def test_a_restore_keeps_the_phase_and_a_device_step_is_waited_for_with_it():
    steps = ChunkSteps(3)
    event = object()
    steps.on_device(0, event)
    restore = update(0, restore_only=True)
    steps.restore(restore)
    assert steps[0].phase is Phase.DEVICE_STEPPED
    assert steps.take_waits(0) == (event, restore)


def test_a_fold_is_owed_once_and_taken_by_exactly_one_thread():
    steps = ChunkSteps(3)
    lazy = update(1)
    steps.owe_fold(lazy)
    with pytest.raises(StepTransitionError, match="already owes"):
        steps.owe_fold(update(1))
    assert steps.owing_folds() == [1] and steps.owed_fold(1) is lazy
    taken = []
    threads = [threading.Thread(target=lambda: taken.append(steps.take_fold(1))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [t for t in taken if t is not None] == [lazy] and steps.owing_folds() == []


def test_retired_chunks_stay_retired_until_unretired_with_the_switch_spare_flag():
    steps = ChunkSteps(5)
    steps.retire(frozenset({3, 1}), spare=True)
    assert steps.retired_chunks() == ([1, 3], True)
    assert steps.retired_chunks() == ([1, 3], True), "looking does not let them go"
    steps.unretire([1, 3])
    assert steps.retired_chunks() == ([], True)
    steps.retire(frozenset({4}), spare=False)
    assert steps.retired_chunks() == ([4], False)
