"""Master weights and gradient accumulation (fp32, or bf16 on request) under a bf16 / fp16 / fp32 module.

The non-ZeRO-Cache path keeps one full replica of the model states per rank:

* the module's parameters in the compute dtype (what forward and backward read),
* an fp32 master copy of each (what the optimizer updates; the parameter itself in fp32 runs),
* one flat fp32 gradient buffer, so accumulation over micro-batches happens in fp32 and the
  data-parallel all-reduce is a few large bucketed calls on one contiguous tensor.

Under DeepSpeed's ``bf16.bf16_master_weights_and_grads`` (``master_dtype`` bf16) the bf16 parameters are their own
masters and the buffer is bf16: the optimizer steps the parameters with bf16 gradients, its moments in the dtype the
optimizer gives them (bf16 with ``bf16_optimizer_states``; see :mod:`angelptm.config.precision_modes`).

What the script does to ``.grad`` counts, as under DeepSpeed (stage 0), where ``step()`` applies what
autograd left in ``.grad`` (issue 28: a GAN's generator loss runs backward through its discriminator,
then ``netD.zero_grad()`` must drop it):

* parameters in the masters' dtype (fp32, or bf16 with bf16 masters: the parameter is its own master): ``.grad``
  *is* the parameter's slice of the buffer.
  A post-accumulate-grad hook adopts a fresh gradient into the slice; later backwards add in place. A
  script's ``zero_grad()`` (to None or to zeros, on the module or on any optimizer) clears the slice:
  :meth:`collect_gradients` treats a ``.grad`` of None as cleared.
* low-precision parameters: the hook folds the gradient into the fp32 slice and frees it only inside the
  engine's own backward (:meth:`accumulating`). A backward outside the engine leaves its gradient in
  ``.grad``, where the script's ``zero_grad()`` reaches it; one still there at ``step()`` is folded in, as
  DeepSpeed's step includes it. (What was folded in an earlier micro-batch of the same accumulation window
  is not cleared by a module's ``zero_grad()`` in between; DeepSpeed's ZeRO-1/2 keep it too.)

``step()`` then: all-reduce (mean) -> unscale -> overflow check (fp16) -> clip -> optimizer step
on the masters -> copy masters back into the compute-dtype parameters.

With expert parallelism the flat buffer holds the dense gradients first and the experts' last, so
each part is reduced over its own group in large calls (see ``angelptm.engine.expert_parallel``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import TYPE_CHECKING, Any, Collection, Iterator

import torch
import torch.distributed as dist

from angelptm.engine.expert_parallel import ExpertParallel
from angelptm.engine.loss_scaler import LossScaler

if TYPE_CHECKING:
    from zero_cache import Sharding, Timeline

logger = logging.getLogger(__name__)


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer so that it steps fp32 master weights of a low-precision module.

    A ``torch.optim.Optimizer`` by type, so torch and transformers LR schedulers attach to it; its
    ``param_groups`` are the wrapped optimizer's, which :meth:`step` runs. ``Optimizer.__init__`` is
    not run: step hooks (``register_step_pre_hook``) are not available.

    Args:
        optimizer: a torch optimizer built over the module's parameters, with no state yet; its
            param groups are re-pointed at the fp32 masters.
        names: id(parameter) -> qualified name, for checkpoints and the consolidated export.
        compute_dtype: dtype of the module's parameters.
        loss_scaler: set for fp16.
        gradient_clipping: max global gradient norm (0 = off).
        group: data-parallel process group, or None for a single process.
        reduce_bucket_numel: elements per all-reduce call.
        experts: expert-parallel layout when MoE experts are spread over ranks (ep_size > 1).
        master_dtype: dtype of the masters and the gradient buffer (fp32, or bf16: bf16_master_weights_and_grads).
        comm_dtypes: id(parameter) -> the dtype its gradient is all-reduced in, where not the buffer's
            (``torch_autocast``'s lower-precision-safe modules under ZeRO, as DeepSpeed's ``comm_dtype``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str],
                 compute_dtype: torch.dtype, loss_scaler: LossScaler | None = None, gradient_clipping: float = 0.0,
                 group: dist.ProcessGroup | None = None, reduce_bucket_numel: int = 500_000_000,
                 experts: ExpertParallel | None = None, master_dtype: torch.dtype = torch.float32,
                 comm_dtypes: dict[int, torch.dtype] | None = None) -> None:
        if optimizer.state:
            raise ValueError("the optimizer already has state; pass a freshly constructed optimizer to initialize()")
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.group = group
        self.reduce_bucket_numel = reduce_bucket_numel
        self.experts = experts
        self.params: list[torch.nn.Parameter] = []  # compute-dtype parameters, in group order
        self.masters: list[torch.Tensor] = []
        self.names: list[str] = []
        for param_group in optimizer.param_groups:
            masters = []
            frozen = [p for p in param_group["params"] if not p.requires_grad]
            if frozen:  # DeepSpeed accepts them too; they simply never change
                logger.info("%d frozen parameters in the optimizer's groups are left out of the update", len(frozen))
            for param in param_group["params"]:
                if not param.requires_grad:
                    continue
                if id(param) not in names:
                    raise ValueError("the optimizer holds a tensor that is not a parameter of the model")
                master = param if param.dtype == master_dtype else param.detach().to(master_dtype).clone()
                self.params.append(param)
                self.masters.append(master)
                self.names.append(names[id(param)])
                masters.append(master)
            param_group["params"] = masters
        total_numel = sum(p.numel() for p in self.params)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.flat_grad = torch.zeros(total_numel, dtype=master_dtype, device=device)
        expert_ids = experts.expert_ids if experts is not None else frozenset()
        self.dense_numel = sum(p.numel() for p in self.params if id(p) not in expert_ids)
        self.grad_views: list[torch.Tensor] = []
        offsets = {False: 0, True: self.dense_numel}  # dense gradients first, then the experts'
        for param in self.params:
            is_expert = id(param) in expert_ids
            start = offsets[is_expert]
            self.grad_views.append(self.flat_grad[start:start + param.numel()].view_as(param))
            offsets[is_expert] += param.numel()
        comm_dtypes = comm_dtypes or {}
        self.low_comm = [(view, comm_dtypes[id(p)]) for p, view in zip(self.params, self.grad_views)
                         if comm_dtypes.get(id(p), master_dtype) != master_dtype and id(p) not in expert_ids]
        """Dense gradients reduced in their own (lower) dtype: views of the buffer with that dtype."""
        self._engine_backward = False
        self.hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]
        self.destroyed = False
        """Whether :meth:`destroy` released the masters and states (then it cannot step)."""
        self.overflow = False
        self.last_grad_norm: float | None = None
        self.sharding: Sharding | None = None
        """None: every rank holds every state (the data-parallel ranks all-reduce gradients, not shard states)."""
        self.timeline: Timeline | None = None
        """Nothing of its own to record: the step runs on the compute stream, which the engine's tracer records."""

    def _make_hook(self, index: int):
        view = self.grad_views[index]
        if self.params[index] is self.masters[index]:
            def adopt(param: torch.nn.Parameter) -> None:
                if param.grad is not view:  # a fresh gradient (.grad was None): it replaces the slice
                    view.copy_(param.grad)
                    param.grad = view
            return adopt

        # Weak: a tensor's hooks are invisible to the garbage collector; a strong reference would keep this
        # optimizer (masters, states) alive as long as the module.
        owner = weakref.ref(self)

        def accumulate(param: torch.nn.Parameter) -> None:
            optimizer = owner()
            if optimizer is not None and optimizer._engine_backward:  # outside, it stays where zero_grad() reaches
                view.add_(param.grad)  # upcasts to fp32; the low-precision gradient is freed right away
                param.grad = None

        return accumulate

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """The engine's own backward runs inside: low-precision gradients go to the fp32 buffer as they come."""
        self._engine_backward = True
        try:
            yield
        finally:
            self._engine_backward = False

    def collect_gradients(self) -> None:
        """Make the flat buffer hold what ``.grad`` holds now (called before the buffer is reduced or read).

        An fp32 parameter whose ``.grad`` the script set to None has an empty slice; one the script replaced
        is copied in. A low-precision parameter's ``.grad`` left by a backward outside the engine is folded in.
        """
        with torch.no_grad():
            for param, master, view in zip(self.params, self.masters, self.grad_views):
                if param is master:
                    if param.grad is None:
                        view.zero_()
                    elif param.grad is not view:
                        view.copy_(param.grad)
                        param.grad = view
                elif param.grad is not None:
                    view.add_(param.grad)
                    param.grad = None

    # The torch.optim.Optimizer surface that schedulers and scripts touch.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not possible: the fp32 masters and gradient buffers are built at ``initialize()``."""
        raise NotImplementedError("the engine's fp32 masters and flat gradient buffer cover the parameters given at "
                                  "initialize(); a param group cannot be added later. Pass every parameter you will "
                                  "train to angelptm.initialize")

    @property
    def gradients_pending(self) -> bool:
        """Never: gradients accumulate in the flat fp32 buffer, apart from the weights, which may be rewritten
        between backward and step (``GatheredParameters``)."""
        return False

    @property
    def params_sharded(self) -> bool:
        """False: every rank holds its whole params (only gradients are reduced over ranks)."""
        return False

    def sync_params(self) -> None:
        """Nothing to bring up to date: every rank's params are whole and current after each step."""

    def tier_usage(self) -> dict[str, tuple[int, int]]:
        """No memory tiers: every state of this rank is on the device (ZeRO-Cache's optimizer plans tiers)."""
        return {}

    def prepare_backward(self, boundary: bool) -> None:
        """Nothing to prepare: gradients accumulate into the flat fp32 buffer (see :meth:`accumulating`)."""

    def finish_pending(self) -> None:
        """Nothing runs in the background: the module's weights are current after every step."""

    def destroy(self) -> None:
        """Remove the gradient hooks and free the fp32 masters, the gradient buffer and the optimizer states now
        (``engine.destroy()``); the module keeps its weights, current after every step. It cannot step again."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for param in self.params:
            param.grad = None  # (an fp32 parameter's gradient is a view of the flat buffer)
        self.optimizer.state.clear()
        for param_group in self.optimizer.param_groups:
            param_group["params"] = []
        self.masters, self.grad_views, self.flat_grad = [], [], torch.empty(0)
        self.destroyed = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradients (the buffer is reused, never freed)."""
        self.flat_grad.zero_()
        for param in self.params:
            param.grad = None

    def step(self) -> bool:
        """Reduce, unscale, check, clip and apply the accumulated gradients.

        Returns:
            True if the update was applied, False if it was skipped for an fp16 overflow.
        """
        if self.destroyed:
            raise RuntimeError("optimizer.step() after engine.destroy(), which released this optimizer's masters and "
                               "states: build a new engine with angelptm.initialize()")
        self.collect_gradients()
        self._all_reduce_mean()
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        if scale != 1.0:
            self.flat_grad.mul_(1.0 / scale)
        # One norm over the flat buffer also detects inf/nan: any non-finite element makes it non-finite.
        # A non-finite gradient skips the step in every precision (fp16 overflow, or a bf16/fp32 NaN
        # that would otherwise silently turn every weight into NaN).
        grad_norm = self._global_norm()
        self.overflow = not math.isfinite(grad_norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.overflow)
        if self.overflow:
            self.last_grad_norm = None
            self.zero_grad()
            return False
        self.last_grad_norm = grad_norm
        if self.gradient_clipping > 0 and grad_norm > self.gradient_clipping:
            # torch.nn.utils.clip_grad_norm_'s rule: multiply by max_norm / (norm + 1e-6).
            self.flat_grad.mul_(self.gradient_clipping / (grad_norm + 1e-6))
        for master, view in zip(self.masters, self.grad_views):
            master.grad = view
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                if param is not master:
                    param.copy_(master)
        self.zero_grad()
        return True

    def _all_reduce_mean(self) -> None:
        """Gradients of the mean loss over the global batch: dense ones averaged over every rank, expert
        ones summed over their expert-data-parallel group and divided by the world size."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        self.flat_grad.mul_(1.0 / dist.get_world_size(self.group))
        low = {dtype: torch.cat([view.flatten() for view, d in self.low_comm if d == dtype]).to(dtype)
               for dtype in {d for _, d in self.low_comm}}  # rounded before the sum, as DeepSpeed's buckets are
        self._all_reduce(self.flat_grad[:self.dense_numel], self.group)
        for dtype, packed in low.items():
            self._all_reduce(packed, self.group)
            start = 0
            for view, d in self.low_comm:
                if d == dtype:
                    view.copy_(packed[start:start + view.numel()].view_as(view))
                    start += view.numel()
        if self.experts is not None and self.experts.edp_group is not None:
            self._all_reduce(self.flat_grad[self.dense_numel:], self.experts.edp_group)

    def _all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup) -> None:
        for start in range(0, flat.numel(), self.reduce_bucket_numel):
            dist.all_reduce(flat[start:start + self.reduce_bucket_numel], group=group)

    def _global_norm(self) -> float:
        """The norm of the whole model's gradient: with expert parallelism each rank holds the dense part
        and one slice of the experts, so the expert squares are summed over the expert-parallel group."""
        if self.experts is None:
            return torch.linalg.vector_norm(self.flat_grad, dtype=torch.float32).item()  # (fp32 over a bf16 buffer)
        parts = (self.flat_grad[:self.dense_numel], self.flat_grad[self.dense_numel:])
        squares = torch.stack([torch.linalg.vector_norm(part, dtype=torch.float32).square() for part in parts])
        dist.all_reduce(squares[1:], group=self.experts.ep_group)
        return squares.sum().sqrt().item()

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """Master weights (fp32, or bf16 under bf16_master_weights_and_grads) by parameter name, on CPU."""
        return {name: master.detach().cpu().clone() for name, master in zip(self.names, self.masters)}

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load fp32 masters by name and refresh the compute-dtype parameters from them."""
        missing = [name for name in self.names if name not in state]
        if missing:
            raise KeyError(f"checkpoint lacks master weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for name, param, master in zip(self.names, self.params, self.masters):
                master.copy_(state[name])
                if param is not master:
                    param.copy_(master)

    def master_values(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """fp32 masters (CPU copies) of the named parameters."""
        wanted = set(names)
        return {name: master.detach().cpu().clone() for name, master in zip(self.names, self.masters)
                if name in wanted}

    def set_master_values(self, values: dict[str, torch.Tensor], *, names: Collection[str] | None = None) -> None:
        """Write the fp32 masters in ``values`` and the module's compute-dtype weights from them (``names``: the
        signature of ZeRO-Cache's; every named parameter is in ``values`` here)."""
        with torch.no_grad():
            for name, param, master in zip(self.names, self.params, self.masters):
                if name in values:
                    master.copy_(values[name].view_as(master))
                    if param is not master:
                        param.copy_(master)

    def refresh_masters_from_params(self) -> None:
        """Set the masters from the module's (possibly lower-precision) weights, e.g. after a module-only load."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                if param is not master:
                    master.copy_(param)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": self.master_state_dict(),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
        }

    def expert_state_dict(self) -> dict[str, Any]:
        """The part of :meth:`state_dict` that differs between expert-parallel ranks: this rank's experts'
        fp32 masters (by name) and optimizer state (by parameter index). Dense states are rank 0's to save."""
        indices = self._expert_indices()
        state = self.optimizer.state_dict()["state"]
        return {"masters": {self.names[i]: self.masters[i].detach().cpu().clone() for i in indices},
                "optimizer_state": {i: state[i] for i in indices if i in state}}

    def load_expert_state_dict(self, saved: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Replace this rank's experts' masters (and optimizer state) with ``saved`` (:meth:`expert_state_dict`)."""
        indices = self._expert_indices()
        with torch.no_grad():
            for i in indices:
                self.masters[i].copy_(saved["masters"][self.names[i]])
                if self.params[i] is not self.masters[i]:
                    self.params[i].copy_(self.masters[i])
        if load_optimizer_states:
            # Through torch's own load_state_dict, which puts each value on its parameter's device and dtype
            # (a fused Adam wants its step counters there too).
            full = self.optimizer.state_dict()
            full["state"].update({i: saved["optimizer_state"][i] for i in indices if i in saved["optimizer_state"]})
            self.optimizer.load_state_dict(full)

    def _expert_indices(self) -> list[int]:
        expert_ids = self.experts.expert_ids if self.experts is not None else frozenset()
        return [i for i, param in enumerate(self.params) if id(param) in expert_ids]

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        self.load_master_state_dict(state["masters"])
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.loss_scaler is not None and state.get("loss_scaler"):
                self.loss_scaler.load_state_dict(state["loss_scaler"])
