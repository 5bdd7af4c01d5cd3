"""What the engine asks of its optimizer: :class:`EngineOptimizer`, the one surface both of its optimizers offer.

The engine holds either :class:`~angelptm.engine.mixed_precision.MixedPrecisionOptimizer` (replicated fp32 masters
and a flat gradient buffer on the device) or :class:`zero_cache.ZeroCacheOptimizer` (chunked states over device,
host and NVMe, sharded over ranks or not). It, its checkpoints (:mod:`angelptm.checkpoints.engine_save` and
:mod:`angelptm.checkpoints.engine_load`), ``GatheredParameters`` and the OOM report call only the members below, so
neither is probed with ``getattr(optimizer, name, default)``: a member one of them lacks, or a renamed one, fails
``tests/unit/test_optimizer_contract.py`` instead of silently taking the default. Where a member means nothing to one
of them (tiers, shards) its answer says so (no tiers, not sharded).
"""

from __future__ import annotations

from typing import Any, Collection, ContextManager, Protocol, runtime_checkable

import torch

from angelptm.engine.loss_scaler import LossScaler
from zero_cache import Sharding, Timeline


@runtime_checkable
class EngineOptimizer(Protocol):
    """The optimizer an :class:`~angelptm.engine.engine.Engine` steps (see the module docstring)."""

    optimizer: torch.optim.Optimizer
    """The client's torch optimizer: its param groups hold the hyperparameters every step reads (schedulers write
    them), and ``initialize()`` returns it in place of the wrapper for plain fp32 (DeepSpeed's choice)."""
    names: list[str]
    """Qualified names of the trained parameters this rank holds masters of, in param-group order."""
    loss_scaler: LossScaler | None
    """fp16's loss scaler; None for bf16 and fp32."""
    last_grad_norm: float | None
    """Global gradient norm (before clipping) of the last applied step; None before one."""
    destroyed: bool
    """Whether :meth:`destroy` ran (then it cannot step)."""
    sharding: Sharding | None
    """How ZeRO-Cache splits the states over ranks; None where every rank holds them all (the replicated one)."""
    timeline: Timeline | None
    """The optimizer's own step timeline (copies, host jobs, disk requests) for a traced step; None: nothing of its
    own to record beside the engine's compute."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The client optimizer's param groups (what LR schedulers write)."""
        ...

    @property
    def gradients_pending(self) -> bool:
        """True while this window's gradients occupy storage the weights need (ZeRO-Cache writes them over the
        param chunks, and host chunks may be updating from them): the weights cannot be rewritten until the
        step. False where gradients accumulate in a buffer of their own."""
        ...

    @property
    def params_sharded(self) -> bool:
        """Each rank stores only its shards of the params, whole only in the fp32 masters."""
        ...

    def prepare_backward(self, boundary: bool) -> None:
        """Called before each backward; ``boundary``: the next ``step()`` applies the update."""
        ...

    def accumulating(self) -> ContextManager[None]:
        """The engine's backward runs inside this: gradients are taken out of ``.grad`` only there."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of this accumulation window."""
        ...

    def step(self) -> bool:
        """Apply the accumulated gradients; False when the step was skipped (non-finite gradients)."""
        ...

    def finish_pending(self) -> None:
        """Block until every update in the background has landed (before reading weights or states)."""
        ...

    def destroy(self) -> None:
        """Free the masters, states and buffers and remove the hooks (``engine.destroy()``)."""
        ...

    def sync_params(self) -> None:
        """Bring every rank's params up to date (a collective where the params are sharded)."""
        ...

    def tier_usage(self) -> dict[str, tuple[int, int]]:
        """Memory tier -> (bytes in use, budget bytes), now; empty where there are no tiers."""
        ...

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by parameter name (this rank's, where sharded)."""
        ...

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load fp32 masters by name and refresh the module's weights from them."""
        ...

    def master_values(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """fp32 masters (CPU copies) of the named parameters this rank holds."""
        ...

    def set_master_values(self, values: dict[str, torch.Tensor], *, names: Collection[str] | None = None) -> None:
        """Write fp32 masters, and the module's weights from them."""
        ...

    def refresh_masters_from_params(self) -> None:
        """Set the masters from the module's weights (after a module-only load)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Masters, optimizer states and loss scaler, for the checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Load :meth:`state_dict`'s masters, and its states unless ``load_optimizer_states`` is False."""
        ...


@runtime_checkable
class ExpertStateOptimizer(EngineOptimizer, Protocol):
    """:class:`EngineOptimizer` with the expert-parallel slices of its checkpoint: the replicated optimizer only, the
    one expert parallelism runs with (ZeRO-Cache refuses ``moe.ep_size > 1``:
    :func:`angelptm.engine.builders.build_optimizer`)."""

    def expert_state_dict(self) -> dict[str, Any]:
        """This rank's experts' masters and optimizer states."""
        ...

    def load_expert_state_dict(self, saved: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Replace this rank's experts' masters (and states) with :meth:`expert_state_dict`'s."""
        ...
