"""Where each chunk stands in the step: one record per chunk, whose states have names and checked transitions.

A chunk's update passes through the training thread (the gradient hook and ``step()`` queue it), the host worker
(which runs it, sends its params back and may owe its moments a fold) and the compute stream (which waits for it
before the next forward uses the chunk). What each of them has done to the chunk was six sets and dicts on three
objects; it is one :class:`ChunkStep` per chunk here, in a :class:`ChunkSteps` table that the optimizer and its host
worker share.

The window's phase of a chunk (:class:`Phase`), set by the training thread::

    WAITING_GRADIENT --speculate--> SPECULATED --revise--> REVISED        (updated from backward, revised at the step)
    WAITING_GRADIENT --queue------> QUEUED                               (a host update queued after the global norm)
    WAITING_GRADIENT --on_device--> DEVICE_STEPPED                       (a host group stepped on the device)
    any ---------------new_window--> WAITING_GRADIENT

Beside the phase, what outlives the window until someone waits for it or lets it go:

* ``host_update`` / ``device_ready``: the chunk's latest host update and device step that the compute stream has not
  ordered itself after (taken by :meth:`ChunkSteps.take_waits`, the forward's and the gradient hook's wait);
* ``params_sent``: the host->device copy of the params that the worker's update queued (the worker's; taken with
  the host update once it is issued);
* ``unfolded``: a lazy update whose moments are still owed (FOLD_PENDING, :mod:`zero_cache.optim.revision`): set
  and taken by the worker, and taken by the training thread only for a chunk with no job left on the worker; taken
  under a lock, as exactly one of the two may fold it;
* ``retired``: the chunk holds a kept gradient that a device-step count switch dropped, until the next step lets it
  go (:meth:`ZeroCacheOptimizer.apply_plan <zero_cache.optim.optimizer.ZeroCacheOptimizer.apply_plan>`).

A transition the step does not make (a second speculation in one window, a revision of a chunk not speculated, a
waited update of a speculated chunk, a fold owed twice) raises :class:`StepTransitionError`: the states are the
update path's invariants, checked where they change. The records cost a few attribute writes per chunk and step; the
hot path (a wait per gradient and per forward pre-hook) reads two attributes.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any, Iterator

ChunkUpdate = Any
"""A :class:`zero_cache.optim.host_update.ChunkUpdate` (not imported: the host worker imports this module)."""


class Phase(enum.Enum):
    """What the current accumulation window has done to a chunk's update (see the module docstring)."""

    WAITING_GRADIENT = "waiting for its gradient"
    """Nothing this window: its gradients are still coming (or it is updated on the device's own stream)."""
    SPECULATED = "updated from backward"
    """A host update queued as soon as backward completed its gradient, with the clip factor taken as 1."""
    REVISED = "revised"
    """The step (or ``zero_grad()``, a skipped step) queued the revision of its update from backward."""
    QUEUED = "queued after the norm"
    """The step queued its host update, which waited for the global norm."""
    DEVICE_STEPPED = "stepped on the device"
    """The step updated its host-held group on the device (:mod:`zero_cache.optim.device_steps`)."""


_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING_GRADIENT: frozenset({Phase.SPECULATED, Phase.QUEUED, Phase.DEVICE_STEPPED}),
    Phase.SPECULATED: frozenset({Phase.REVISED}),
    Phase.REVISED: frozenset(),
    Phase.QUEUED: frozenset(),
    Phase.DEVICE_STEPPED: frozenset(),
}
"""The phases each phase may move to within a window (:meth:`ChunkSteps.new_window` starts every chunk again)."""


class StepTransitionError(RuntimeError):
    """A chunk's update was asked to move between states the step never moves it between (a bug, not bad input)."""


@dataclass(slots=True)
class ChunkStep:
    """One chunk's place in the step (see the module docstring for who writes which field)."""

    chunk: int
    phase: Phase = Phase.WAITING_GRADIENT
    speculative: ChunkUpdate | None = None
    """This window's update from backward (SPECULATED or REVISED), which the step's revision revises."""
    host_update: ChunkUpdate | None = None
    """The latest host update queued for the chunk that the compute stream has not waited for."""
    device_ready: Any = None
    """The event after which its device step's params are in place, not yet waited for (None on CPU)."""
    params_sent: Any = None
    """The worker's: the completion event of the latest host->device copy of its params."""
    unfolded: ChunkUpdate | None = None
    """The worker's: a lazy update whose moments are still to be folded in from the kept gradient."""
    retired: bool = False
    """It keeps a kept gradient that a count switch dropped, until the next step releases it."""

    def check(self, phase: Phase) -> None:
        """Raise :class:`StepTransitionError` unless the chunk may move to ``phase`` now (nothing changes)."""
        if phase not in _NEXT[self.phase]:
            raise StepTransitionError(f"chunk {self.chunk}: its update cannot go from {self.phase.name} to "
                                      f"{phase.name} in one window")

    def move(self, phase: Phase) -> None:
        self.check(phase)
        self.phase = phase


class ChunkSteps:
    """The :class:`ChunkStep` of every chunk, indexed by chunk id, and the transitions between their states.

    Args:
        num_chunks: chunks in the layout.
    """

    def __init__(self, num_chunks: int) -> None:
        self.records = [ChunkStep(chunk) for chunk in range(num_chunks)]
        self.retired_spare = False
        """Whether the retired chunks' kept gradients go to the spares (a trial count's switch) or are freed."""
        self._folds = threading.Lock()

    def __getitem__(self, chunk: int) -> ChunkStep:
        return self.records[chunk]

    # ------------------------------------------------------------------ the window (training thread)
    def speculate(self, update: ChunkUpdate) -> None:
        """``update`` was queued from backward: the step revises it."""
        record = self.records[update.chunk]
        record.move(Phase.SPECULATED)
        record.speculative = record.host_update = update

    def revise(self, revision: ChunkUpdate) -> None:
        """The revision of the chunk's update from backward was queued."""
        record = self.records[revision.chunk]
        record.move(Phase.REVISED)
        record.host_update = revision

    def queue(self, update: ChunkUpdate) -> None:
        """The step queued the chunk's host update (after the global norm)."""
        record = self.records[update.chunk]
        record.move(Phase.QUEUED)
        record.host_update = update

    def restore(self, update: ChunkUpdate) -> None:
        """A rewrite of the chunk's params from its masters was queued (no step: its phase stays)."""
        record = self.records[update.chunk]
        if record.speculative is not None:
            raise StepTransitionError(f"chunk {update.chunk}: its params cannot be restored from the masters while "
                                      f"its update from backward ({record.phase.name}) stands")
        record.host_update = update

    def check_on_device(self, chunk: int) -> None:
        """Raise :class:`StepTransitionError` unless the step may queue the chunk's update on the device now; checked
        before the update is queued, so that a refused one is never queued (:meth:`on_device` records it after)."""
        self.records[chunk].check(Phase.DEVICE_STEPPED)

    def on_device(self, chunk: int, ready: Any) -> None:
        """The step queued the chunk's update on the device; ``ready``: its params are in place after it."""
        record = self.records[chunk]
        record.move(Phase.DEVICE_STEPPED)
        record.device_ready = ready

    def speculated(self) -> dict[int, ChunkUpdate]:
        """Chunk -> this window's update from backward, in chunk order."""
        return {r.chunk: r.speculative for r in self.records if r.speculative is not None}

    def new_window(self) -> None:
        """Every chunk waits for its next gradient (what is in flight stays until waited for)."""
        for record in self.records:
            record.phase = Phase.WAITING_GRADIENT
            record.speculative = None

    # ------------------------------------------------------------------ waiting (training thread)
    def take_waits(self, chunk: int) -> tuple[Any, ChunkUpdate | None]:
        """(device step's event, host update) that the compute stream has not waited for, now taken."""
        record = self.records[chunk]
        stepped, update = record.device_ready, record.host_update
        if stepped is not None or update is not None:
            record.device_ready = record.host_update = None
        return stepped, update

    def take_params_sent(self, chunk: int) -> Any:
        """The worker's latest host->device copy of the chunk's params, taken (read once its update is issued)."""
        record = self.records[chunk]
        sent, record.params_sent = record.params_sent, None
        return sent

    def in_flight(self) -> list[int]:
        """Chunks with a host update the compute stream has not waited for."""
        return [r.chunk for r in self.records if r.host_update is not None]

    # ------------------------------------------------------------------ folds (the worker; see the module docstring)
    def owe_fold(self, update: ChunkUpdate) -> None:
        """``update`` was applied lazily: its moments are owed from the kept gradient."""
        record = self.records[update.chunk]
        with self._folds:
            if record.unfolded is not None:
                raise StepTransitionError(f"chunk {update.chunk} already owes the moments of a lazy update: it "
                                          "must be folded before another is owed")
            record.unfolded = update

    def take_fold(self, chunk: int) -> ChunkUpdate | None:
        """The chunk's owed lazy update, taken (the taker folds it), or None."""
        record = self.records[chunk]
        with self._folds:
            lazy, record.unfolded = record.unfolded, None
        return lazy

    def owed_fold(self, chunk: int) -> ChunkUpdate | None:
        """The chunk's owed lazy update, left in place."""
        return self.records[chunk].unfolded

    def owing_folds(self) -> list[int]:
        """Chunks that owe the moments of a lazy update."""
        return [r.chunk for r in self.records if r.unfolded is not None]

    def forget_folds(self) -> None:
        """Drop every owed fold (the states are being freed)."""
        with self._folds:
            for record in self.records:
                record.unfolded = None

    # ------------------------------------------------------------------ retired kept gradients (training thread)
    def retire(self, chunks: frozenset[int], *, spare: bool) -> None:
        """``chunks`` keep their kept gradients until :meth:`unretire` (``spare``: then to the spares)."""
        for chunk in chunks:
            self.records[chunk].retired = True
        self.retired_spare = spare

    def retired_chunks(self) -> tuple[list[int], bool]:
        """(the retired chunks in order, whether their kept gradients go to the spares), left retired: they stay so
        until their kept gradients are let go of (:meth:`unretire`), so that a failure on the way (a host job's, met
        while their chunks finish) leaves them to the next try instead of forgetting them."""
        return [r.chunk for r in self.records if r.retired], self.retired_spare

    def unretire(self, chunks: list[int]) -> None:
        """``chunks``' kept gradients were let go of: no longer retired."""
        for chunk in chunks:
            self.records[chunk].retired = False

    def __iter__(self) -> Iterator[ChunkStep]:
        return iter(self.records)
