"""Host updates during backward that stay exact: update early, keep the gradient, revise at the step.

A host chunk's CPU Adam should start as soon as backward has finished its gradient, so that it runs
under the rest of backward and not after it. But two things are known only when backward has
ended: the clip factor ``min(1, max_norm / ||g||)`` over the global norm, and whether some gradient
is inf/NaN (the step is then skipped). So each step goes:

1. **Speculate.** During backward a host chunk whose gradient is complete is updated with the factor
   known then: 1 / loss scale (and 1 / ranks when sharded), clip factor 1. The update is *lazy*: it
   stores the new weight (master and the copy sent to the device) but not the new moments, and copies
   its gradient into the chunk's *kept gradient* (pinned, one param chunk's bytes, planned by
   :mod:`zero_cache.plan.planner`; with accumulating micro-batches the fp32 accumulator is kept anyway).
2. **Defer.** The worker sums the squared norms of this step's chunks (:class:`SpeculationWindow`) in the
   order backward completed them. Once the partial norm already exceeds ``max_norm``, or a chunk's
   gradient is non-finite, the step will be clipped or skipped, so the chunks after it are *deferred*:
   their gradient is kept, nothing is applied. The order is backward's, not the order the worker runs
   the updates in: ``step()`` re-sorts those not yet started into forward order, and how many that is
   depends on thread timing. An applied-then-revised chunk and a deferred one agree only to an ulp,
   so an outcome that followed the worker's progress would make a run's bits differ from run to run.
3. **Revise.** ``step()`` knows the global norm and queues one revision per speculated chunk, in
   forward order (what the next forward needs first):

   ====================  =====================================  ===========================
   the step              applied chunk                          deferred chunk
   ====================  =====================================  ===========================
   not clipped           stands (nothing to do: the usual case)  stepped from the kept gradient
   clipped               weight taken back, step redone with     stepped with the true factor
                         the true factor (one fused pass)
   skipped (inf/NaN)     weight taken back                      weights rewritten from masters
   ====================  =====================================  ===========================

4. **Fold.** An applied step that stands still owes its moments. They are folded in from the kept
   gradient at the chunk's next update, in the same pass (``csrc/fused_host_adam.cpp``: 2 more bytes
   read per element), or by a pass of their own just before the kept gradient is overwritten (a
   deferral, the next window's first accumulation) or the states are read (``finish_pending``:
   checkpoints, re-plans). The fold runs the step's own moment lines on the same scaled gradient,
   so with the csrc kernel a lazy step folded later leaves the very bits an update after backward
   leaves (the library kernels' fold agrees with their step to rounding).
5. **Predict.** After a clipped step the next is expected to clip too, and its host chunks wait for the
   step (every speculation would be redone); after an unclipped step speculation resumes.
6. **Waited steps.** A host update that waits for the norm runs between backward's end and the next forward's
   need of its chunk, the one stretch of a clipped step the host's Adam lengthens. There it stores the weight
   alone and keeps its gradient (the lazy step of 1.: 22 bytes an element instead of 28, for a chunk with a kept
   gradient), and a job queued behind the step's updates folds its moments in (18 more) while the worker would
   otherwise wait for the next norm. The fold is 4.'s, so the states are the bits an eager update leaves
   (``tests/unit/test_zero_cache_revision.py``); a chunk the next step updates in backward folds it in its pass.

*Exactness.* Taking a lazy step back touches only the weight: its moments are recomputed from the
stored ones and the kept gradient, and the weight line of Adam runs backwards
(``w = (w' + lr/bc1 * m' / (sqrt(v')/sqrt(bc2) + eps)) / (1 - lr*wd)``), which returns the master
within a few ulps of its terms; the moments were never changed. So a clipped step redone, a skipped
step and ``zero_grad()`` after backward all match the reference (``clip_grad_norm_`` + AdamW) to 1e-6
per tensor whatever the spike, and an unclipped step is bit for bit an update after backward
(``tests/unit/test_zero_cache_revision.py``). Three cases stay *eager* (the moments stored at once and
run backwards when taken back, which returns each within an ulp of its stepped value, so a gradient
that jumps by orders of magnitude leaves up to ~1e-5 of a tensor): Adam with L2 decay, whose gradient
reads the old weight, so its weight line cannot be inverted alone; an NVMe-resident group, whose
states are on disk between steps (folding there would cost a disk round trip); and fp16 gradients on
DeepSpeed's cpu_adam, where stepping copies of the moments cost more than the step itself
(:meth:`zero_cache.optim.host_adam.HostAdam.lazy_ok`). The usual fp16 overflow still defers every chunk
before any is applied, which is exact.

*Cost.* The kept gradient: 2 bytes per parameter of a host chunk (bf16), after the optimizer states
in the host budget; a chunk that gets none is updated after backward. A lazy pass that folds the step
before moves 32 bytes per element instead of 28. A clipped step runs one revision pass (about one
Adam step) per speculated chunk after backward; a disk group's states are read and written once more.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Protocol

APPLIED, DEFERRED = "applied", "deferred"


class Speculated(Protocol):
    """What a revision reads of an update (``zero_cache.optim.host_update.ChunkUpdate`` has it): this module knows
    the rule, not the worker that runs it, so it imports nothing of it."""

    grad_factor: float
    outcome: str | None
    skip: bool


class SpeculationWindow:
    """One step's speculative updates: which of them the worker still applies (it alone calls :meth:`admits`).

    An update's outcome is a function of the gradients alone: it is applied when the squared norms of the
    window's chunks up to it, in the order they joined (backward's), sum to at most the limit. The worker may
    run the updates in another order (they are re-sorted for the next forward), so reaching one it takes the
    squared norms of those that joined before it, whether or not it has run them yet.

    Args:
        max_norm: the clip threshold (0 = no clipping: only a non-finite gradient defers).
        grad_factor: the factor the speculative updates use (1 / loss scale / ranks): the true norm is the
            chunks' summed squared norms, square-rooted, times it.
    """

    def __init__(self, max_norm: float, grad_factor: float) -> None:
        self.limit = (max_norm / grad_factor) ** 2 if max_norm > 0 else math.inf
        self._joined: list[Any] = []
        """The updates in the order they joined; an entry is dropped (None) once its square is summed."""
        self._partials: list[float] = []
        """Summed squared norms of the joined updates up to each one (a prefix of :attr:`_joined`, the worker's)."""

    def join(self, update: Any) -> int:
        """Training thread, before queueing ``update``: it is the window's next chunk; returns its position."""
        self._joined.append(update)
        return len(self._joined) - 1

    def admits(self, position: int, square_of: Callable[[Any], float]) -> bool:
        """Whether the update at ``position`` may be applied now; ``square_of(update)`` gives a joined update's
        squared gradient norm (called once per update, in joining order, up to ``position``)."""
        while len(self._partials) <= position:
            index = len(self._partials)
            square = square_of(self._joined[index])
            self._joined[index] = None  # (the window holds no update it no longer needs)
            previous = self._partials[-1] if self._partials else 0.0
            self._partials.append(previous + square if math.isfinite(square) else math.inf)
        partial = self._partials[position]
        return math.isfinite(partial) and partial <= self.limit


def revision_scales(original: Speculated, revision: Speculated) -> tuple[float, float]:
    """(undo scale, redo scale) of a revision, 0 meaning none: take back the step ``original`` made with its
    factor, and/or make it with the step's true factor (``revision.grad_factor``)."""
    applied = original.outcome == APPLIED
    if revision.skip:
        return (original.grad_factor if applied else 0.0), 0.0
    if applied and revision.grad_factor == original.grad_factor:
        return 0.0, 0.0
    return (original.grad_factor if applied else 0.0), revision.grad_factor
