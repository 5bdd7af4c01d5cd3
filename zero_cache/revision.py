"""Host updates during backward that stay exact: update early, keep the gradient, revise at the step.

A host chunk's CPU Adam should start as soon as backward has finished its gradient, so that it runs
under the rest of backward and not after it. But two things are known only when backward has
ended: the clip factor ``min(1, max_norm / ||g||)`` over the global norm, and whether some gradient
is inf/NaN (the step is then skipped). So each step goes:

1. **Speculate.** During backward a host chunk whose gradient is complete is updated with the factor
   known then: 1 / loss scale (and 1 / ranks when sharded), clip factor 1. In the same pass the
   update copies its gradient into the chunk's *kept gradient* (pinned, one param chunk's bytes,
   planned by :mod:`zero_cache.planner`; with accumulating micro-batches the fp32 accumulator is
   kept anyway).
2. **Defer.** The worker sums the squared norms of this step's chunks as it goes (:class:`SpeculationWindow`).
   Once the partial norm already exceeds ``max_norm``, or a chunk's gradient is non-finite, the step
   will be clipped or skipped, so the chunks after it are *deferred*: their gradient is kept, nothing
   is applied.
3. **Revise.** ``step()`` knows the global norm and queues one revision per speculated chunk, in
   forward order (what the next forward needs first):

   ====================  =====================================  ===========================
   the step              applied chunk                          deferred chunk
   ====================  =====================================  ===========================
   not clipped           stands (nothing to do: the usual case)  stepped from the kept gradient
   clipped               taken back, redone with the true        stepped with the true factor
                         factor (one fused pass)
   skipped (inf/NaN)     taken back                             weights rewritten from masters
   ====================  =====================================  ===========================

4. **Predict.** After a clipped step the next is expected to clip too, and its host chunks wait for the
   step (every speculation would be redone); after an unclipped step speculation resumes.

*Exactness.* Adam's step is invertible given its gradient: run its lines backwards
(``csrc/fused_host_adam.cpp``'s ``adam_revise_``, :func:`zero_cache.host_adam.undo_adam_`). Each state
comes back within about one fp32 ulp of its *stepped* value (at step 1 the moments come back to exactly
zero). A redone step matched the reference clipped step to 1e-6 per tensor in the tests, at norms up to
3x the threshold. Two limits, both from that ulp being relative to the stepped value: a spike far above
the threshold (10x) on a chunk that was applied leaves its exp_avg_sq about 2e-6 off; and where an
element's gradient jumped by orders of magnitude since the step before (typical of the first steps), the
ulp is a large part of its old exp_avg_sq, which Adam turns into an lr-sized change of that weight: up
to ~2e-5 of a tensor after a step taken back. Exact in every case would be to leave the moments
unstepped until the norm is known and fold the kept gradient into them at the chunk's next update (the
masters alone are revised then, to within an ulp); that is not built.

*Cost.* The kept gradient: 2 bytes per parameter of a host chunk (bf16), after the optimizer states
in the host budget; a chunk that gets none is updated after backward. The fused pass writes 2 more
bytes per element (30 instead of 28). A clipped step runs one revision pass (about one Adam step)
per speculated chunk after backward; a disk group's states are read and written once more.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zero_cache.host_update import ChunkUpdate

APPLIED, DEFERRED = "applied", "deferred"


class SpeculationWindow:
    """One step's speculative updates: which of them the worker still applies (it alone calls :meth:`admits`).

    Args:
        max_norm: the clip threshold (0 = no clipping: only a non-finite gradient defers).
        grad_factor: the factor the speculative updates use (1 / loss scale / ranks): the true norm is the
            chunks' summed squared norms, square-rooted, times it.
    """

    def __init__(self, max_norm: float, grad_factor: float) -> None:
        self.limit = (max_norm / grad_factor) ** 2 if max_norm > 0 else math.inf
        self.partial = 0.0
        """Summed squared norms of the chunks seen so far (a lower bound of the step's)."""

    def admits(self, square: float) -> bool:
        """Add one chunk's squared gradient norm; whether its update may be applied now."""
        self.partial += square if math.isfinite(square) else math.inf
        return math.isfinite(self.partial) and self.partial <= self.limit


def revision_scales(original: "ChunkUpdate", revision: "ChunkUpdate") -> tuple[float, float]:
    """(undo scale, redo scale) of a revision, 0 meaning none: take back the step ``original`` made with its
    factor, and/or make it with the step's true factor (``revision.grad_factor``)."""
    applied = original.outcome == APPLIED
    if revision.skip:
        return (original.grad_factor if applied else 0.0), 0.0
    if applied and revision.grad_factor == original.grad_factor:
        return 0.0, 0.0
    return (original.grad_factor if applied else 0.0), revision.grad_factor
