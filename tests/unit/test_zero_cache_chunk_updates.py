"""The update side's bookkeeping (:class:`~zero_cache.optim.chunk_updates.ChunkUpdates`) against its step records: a
transition the record refuses queues nothing, and a failure while retired kept gradients are finished leaves them
retired for the next try.

The store, the device steps and the host worker are fakes that record what they were asked; the step records are the
real :class:`~zero_cache.optim.step_record.ChunkSteps`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zero_cache.optim.chunk_updates import ChunkUpdates
from zero_cache.optim.host_update import ChunkUpdate
from zero_cache.optim.step_record import ChunkSteps, Phase, StepTransitionError
from zero_cache.plan.tier_names import DEVICE


class FakeDeviceSteps:
    """Records the chunks whose device step was queued and waited for."""

    def __init__(self) -> None:
        self.queued: list[int] = []
        self.waited: list[int] = []

    def step(self, chunk, members, hypers, step, grad_factor, grads_ready=None):
        self.queued.append(chunk)
        return None  # (no event on a CPU run)

    def wait(self, chunk: int) -> None:
        self.waited.append(chunk)


class FakeHost:
    """The host worker: failed with ``error`` (raised at the next wait) until it is cleared."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.settled: list[int] = []

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def settle(self, chunk: int) -> None:
        self.settled.append(chunk)


class FakeStore:
    """The chunk storage as the update side sees it: the device's tier, and the kept gradients let go of."""

    def __init__(self) -> None:
        self.tiers = {DEVICE: SimpleNamespace(device=torch.device("cpu"))}
        self.released: list[tuple[frozenset[int], bool]] = []

    def release_kept(self, chunks: frozenset[int], *, spare: bool) -> None:
        self.released.append((chunks, spare))


def updates_of(num_chunks: int) -> tuple[ChunkUpdates, ChunkSteps, FakeStore, FakeDeviceSteps, FakeHost]:
    steps, store, device_steps, host = ChunkSteps(num_chunks), FakeStore(), FakeDeviceSteps(), FakeHost()
    counters = SimpleNamespace(counts={"device_stepped_chunks": 0})
    staged: list[int] = []
    updates = ChunkUpdates(store, SimpleNamespace(), host, device_steps, steps=steps, counters=counters,
                           before_update=staged.append, landed=lambda chunk: None)
    return updates, steps, store, device_steps, host


def issued_update(chunk: int) -> ChunkUpdate:
    """A host update the worker has issued (nothing left to wait for but the worker's failure)."""
    update = ChunkUpdate(chunk=chunk, members={}, hypers=[], step=1)
    update.issued.set()
    return update


@pytest.mark.parametrize("earlier", ["device step", "host update"])
def test_a_device_step_the_record_refuses_is_never_queued(earlier):
    num_chunks = 4
    chunk = torch.randint(0, num_chunks, ()).item()
    updates, steps, _, device_steps, _ = updates_of(num_chunks)
    if earlier == "device step":  # stepped on the device once this window already
        updates.step_on_device(chunk, {}, [], 1, 1.0)
        assert device_steps.queued == [chunk] and steps[chunk].phase is Phase.DEVICE_STEPPED
    else:  # its host update was queued after the norm
        steps.queue(issued_update(chunk))
    phase = steps[chunk].phase
    queued = list(device_steps.queued)
    with pytest.raises(StepTransitionError, match=f"chunk {chunk}: .* to DEVICE_STEPPED"):
        updates.step_on_device(chunk, {}, [], 2, 1.0)
    assert device_steps.queued == queued, "a device step was queued for a chunk whose record refused it"
    assert steps[chunk].phase is phase
    other = (chunk + 1) % num_chunks  # a chunk the record lets step is queued as before
    updates.step_on_device(other, {}, [], 2, 1.0)
    assert device_steps.queued == [*queued, other] and steps[other].phase is Phase.DEVICE_STEPPED


def test_retired_kept_gradients_outlive_a_host_failure_while_their_chunks_finish():
    num_chunks = 6
    retired = sorted(torch.randperm(num_chunks)[:3].tolist())
    spare = bool(torch.randint(0, 2, ()).item())
    updates, steps, store, _, host = updates_of(num_chunks)
    steps.retire(frozenset(retired), spare=spare)
    for chunk in retired:  # each still has a host update the forward has not waited for
        steps.queue(issued_update(chunk))
    host.error = RuntimeError("the host worker failed")
    with pytest.raises(RuntimeError, match="host worker failed"):
        updates.release_retired()
    assert store.released == [], "kept gradients were let go of while their chunks' host work had failed"
    assert [r.chunk for r in steps if r.retired] == retired and steps.retired_spare is spare
    host.error = None  # (the failure dealt with): the next step lets them go, once
    updates.release_retired()
    assert store.released == [(frozenset(retired), spare)]
    assert not any(r.retired for r in steps)
    updates.release_retired()
    assert store.released == [(frozenset(retired), spare)]
