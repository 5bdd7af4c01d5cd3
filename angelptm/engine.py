"""The training engine: DeepSpeed's engine API over a module, its mixed-precision optimizer and its data.

The engine orchestrates; the work lives in the pieces it holds: :class:`MixedPrecisionOptimizer`
(master weights, accumulation, all-reduce, clipping), the schedule, the loader, and
``angelptm.checkpoint`` (atomic files). ZeRO-Cache will plug in as another model-states manager
behind the same calls.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from angelptm import checkpoint
from angelptm.config.typed import EngineConfig
from angelptm.data.loader import ResumableDataLoader
from angelptm.distributed import DistContext
from angelptm.errors import CheckpointError
from angelptm.expert_parallel import ExpertParallel
from angelptm.mixed_precision import MixedPrecisionOptimizer
from angelptm.monitor import MetricsSink

logger = logging.getLogger(__name__)


def _to_device(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Move tensors (inside tuples, namedtuples, lists and dicts) to the device; cast floating ones if asked."""
    if isinstance(value, torch.Tensor):
        value = value.to(device, non_blocking=True)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_to_device(v, device, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device, dtype) for k, v in value.items()}
    return value


class Engine(nn.Module):
    """What :func:`angelptm.initialize` returns first; call it like the module.

    Args:
        module: the model, already on ``ctx.device`` in the compute dtype.
        config: the typed config.
        ctx: this rank's distributed context.
        optimizer: the mixed-precision optimizer, or None for forward/backward only.
        lr_scheduler: an object with ``step()`` and ``state_dict()``, or None.
        training_dataloader: the loader built from ``training_data``, or None.
    """

    def __init__(self, module: nn.Module, config: EngineConfig, ctx: DistContext,
                 optimizer: MixedPrecisionOptimizer | None, lr_scheduler: Any,
                 training_dataloader: ResumableDataLoader | None, experts: ExpertParallel | None = None) -> None:
        super().__init__()
        self.experts = experts  # expert-parallel layout (moe.ep_size > 1), with or without an optimizer
        self.module = module
        self.config = config
        self.ctx = ctx
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.compute_dtype = config.precision.dtype
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._timings: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.monitor = MetricsSink(config.monitor.csv_dir, config.monitor.tensorboard_dir) if ctx.is_main else None
        self._loss_sum: torch.Tensor | None = None  # this step's micro-batch losses, kept on the device

    # ----------------------------------------------------------------- DeepSpeed's accessors
    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies the optimizer (DeepSpeed's definition)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        """Current learning rate of each param group."""
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """False if the last boundary step was skipped for an fp16 overflow."""
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        scaler = self.optimizer.loss_scaler if self.optimizer else None
        return scaler.scale if scaler else 1.0

    @property
    def global_rank(self) -> int:
        return self.ctx.rank

    @property
    def dp_world_size(self) -> int:
        return self.ctx.world_size

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def get_mom(self) -> list:
        """Adam's betas per param group (DeepSpeed's name)."""
        return [group.get("betas") for group in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last applied step."""
        return self.optimizer.last_grad_norm if self.optimizer else None

    # ----------------------------------------------------------------- forward / backward / step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; tensors move to the device (floating ones to the compute dtype with fp16.auto_cast)."""
        start = self._clock()
        cast = self.compute_dtype if self.config.precision.cast_inputs else None
        args = _to_device(args, self.device, cast)
        kwargs = _to_device(kwargs, self.device, cast)
        output = self.module(*args, **kwargs)
        self._timings["forward"] += self._clock() - start
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the fp16 loss scale).

        Gradients accumulate in fp32 inside the optimizer until the boundary ``step()``.

        Returns:
            The loss divided by the accumulation steps (with ``scale_wrt_gas``), as DeepSpeed does.
        """
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        start = self._clock()
        if self.optimizer is not None:
            self.optimizer.prepare_backward(self.is_gradient_accumulation_boundary())
        if scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps()
        scaled = loss.float() * self.loss_scale
        scaled.backward(retain_graph=retain_graph)
        if self.monitor is not None and self.monitor.enabled:
            detached = loss.detach().float() * (self.gradient_accumulation_steps() if scale_wrt_gas else 1)
            self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._timings["backward"] += self._clock() - start
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated so far (they live in the optimizer's fp32 buffers)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        self.module.zero_grad(set_to_none=set_to_none)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End a micro-step; at an accumulation boundary, update the weights and the schedule."""
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: add an \"optimizer\" section to the config "
                               "or pass optimizer= to angelptm.initialize")
        self._step_applied = False
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        start = self._clock()
        scale_before = self.loss_scale
        self._step_applied = self.optimizer.step()
        if self._step_applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
            if self.ctx.is_main:
                change = (f"loss scale lowered to {self.loss_scale:g}" if self.loss_scale != scale_before
                          else f"loss scale kept at {self.loss_scale:g} (hysteresis)")
                logger.warning("non-finite gradients (overflow) at step %d: step skipped, %s",
                               self.global_steps + 1, change)
        self.micro_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._timings["step"] += self._clock() - start
        if self.monitor is not None and self.monitor.enabled:
            self._write_monitor()
        if self.global_steps % self.config.monitor.steps_per_print == 0 and self.ctx.is_main:
            self._print_progress()

    def _write_monitor(self) -> None:
        """DeepSpeed's per-step monitor scalars (rank 0; the loss is this rank's micro-batch mean)."""
        metrics = {"lr": self.get_lr()[0] if self.get_lr() else None, "loss_scale": self.loss_scale,
                   "grad_norm": self.get_global_grad_norm(), "samples": self.global_samples}
        if self._loss_sum is not None:
            metrics["loss"] = self._loss_sum.item() / self.gradient_accumulation_steps()
            self._loss_sum = None
        self.monitor.write(self.global_steps, metrics)

    def _clock(self) -> float:
        if self.config.monitor.wall_clock_breakdown and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _print_progress(self) -> None:
        line = f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}"
        if self.config.monitor.wall_clock_breakdown:
            line += " | " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self._timings.items())
            self._timings = dict.fromkeys(self._timings, 0.0)
        logger.info(line)

    # ----------------------------------------------------------------- checkpoints
    @property
    def zero_cache_shards(self) -> int:
        """Ranks over which ZeRO-Cache shards the optimizer states (1: not sharded)."""
        sharding = getattr(self.optimizer, "sharding", None)
        return sharding.world_size if sharding is not None else 1

    def _named_master_weights(self) -> dict[str, torch.Tensor]:
        if self.optimizer is None:
            return {name: p.detach().float().cpu().clone() for name, p in self.module.named_parameters()}
        masters = self.optimizer.master_state_dict()
        if self.zero_cache_shards > 1:  # each rank holds its chunks' masters: a collective gathers them all
            parts: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(parts, masters, group=self.ctx.group)
            masters = {name: tensor for part in parts for name, tensor in part.items()}
        return masters

    def _param_aliases(self) -> dict[str, str]:
        """state_dict key -> the named_parameters name of the same tensor (tied weights)."""
        canonical = {id(p): name for name, p in self.module.named_parameters()}
        return {key: canonical[id(t)] for key, t in self.module.state_dict(keep_vars=True).items()
                if id(t) in canonical}

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full module state dict with fp32 weights on CPU, loadable into the plain model.

        With sharded ZeRO-Cache states every rank must call it (the masters are gathered)."""
        if self.experts is not None:
            raise NotImplementedError("consolidating a model whose experts are spread over ranks (moe.ep_size > 1) "
                                      "needs every rank's experts: save a checkpoint and export it offline with "
                                      "`python -m angelptm.export`")
        masters = self._named_master_weights()  # first: it waits for weights still landing from the last step
        self._sync_params()
        return checkpoint.consolidate(self.module.state_dict(), masters, self._param_aliases())

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Path:
        """Save model, optimizer, scheduler, loss scaler, RNG and data position atomically.

        Saving between accumulation boundaries drops the partial gradient sum (as DeepSpeed does);
        that is logged, since the resumed step then sums fewer micro-batches.

        Returns:
            The checkpoint directory ``save_dir/tag``.
        """
        tag = tag or f"global_step{self.global_steps}"
        if self.micro_steps % self.gradient_accumulation_steps() and self.ctx.is_main:
            logger.warning("saving in the middle of gradient accumulation (micro-step %d of %d): the partial "
                           "gradients are not saved", self.micro_steps % self.gradient_accumulation_steps(),
                           self.gradient_accumulation_steps())

        experts = self.experts
        shards = self.zero_cache_shards
        self._sync_params()  # rank 0 writes the module: its non-owned chunks come from their owners first

        def shared() -> dict[str, Any]:
            if self.optimizer is not None:
                self.optimizer.finish_pending()  # weights may still be landing from a background update
            module_state = self.module.state_dict()
            aliases = self._param_aliases()
            held = self._sharded_weight_keys(aliases)
            module_state = {k: v for k, v in module_state.items() if k not in held}  # they are in the masters
            if exclude_frozen_parameters:
                frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
                module_state = {k: v for k, v in module_state.items() if k not in frozen}
            model_states = {
                "format_version": checkpoint.FORMAT_VERSION, "module": module_state,
                "param_aliases": aliases, "weights_in_masters": bool(held),
                "global_steps": self.global_steps,
                "global_samples": self.global_samples, "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps, "world_size": self.world_size,
                "ep_size": experts.ep_size if experts is not None else 1, "zero_cache_shards": shards,
                "expert_state_keys": sorted(self._expert_state_names(experts)) if experts is not None else [],
                "dtype": str(self.compute_dtype), "client_state": dict(client_state or {}),
            }
            files = {checkpoint.MODEL_FILE: model_states}
            if self.optimizer is not None:
                files[checkpoint.OPTIM_FILE] = {
                    "optimizer": self.optimizer.state_dict(),
                    "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                }
            return files

        per_rank = {"rng": checkpoint.capture_rng_state(),
                    "data": self.training_dataloader.state_dict() if self.training_dataloader else None}
        if shards > 1 and self.ctx.rank > 0:  # rank 0's shard is in the optimizer file
            per_rank[checkpoint.ZERO_CACHE_SHARD] = self.optimizer.state_dict()
        if experts is not None and 0 < self.ctx.rank < experts.ep_size:
            # The shared files hold rank 0's experts; ranks 1..W-1 of the first expert-parallel group
            # hold the other slices, so they write theirs (every expert-data-parallel replica equals one).
            expert_names = self._expert_state_names(experts)
            per_rank["experts"] = {"module": {k: v for k, v in self.module.state_dict().items() if k in expert_names},
                                   "optimizer": self.optimizer.expert_state_dict() if self.optimizer is not None
                                   else None}
        return checkpoint.save(save_dir, tag, self.ctx, shared=shared, per_rank=per_rank, save_latest=save_latest)

    def _expert_state_names(self, experts: ExpertParallel) -> set[str]:
        ids = {id(t) for t in self.module.parameters() if id(t) in experts.expert_ids}
        return {k for k, t in self.module.state_dict(keep_vars=True).items() if id(t) in ids}

    def _load_expert_slice(self, path: Path, *, load_optimizer_states: bool, module_only: bool) -> None:
        """Ranks of expert-parallel index p > 0 replace rank 0's experts with slice p's, saved by global rank p."""
        experts = self.experts
        if experts is None or experts.ep_rank == 0:
            return
        source = path / checkpoint.rank_file(experts.ep_rank)
        saved = checkpoint.load_file(source).get("experts") if source.is_file() else None
        if saved is None:
            raise CheckpointError(f"{source} lacks the experts of expert-parallel index {experts.ep_rank}: the "
                                  f"checkpoint was not saved with moe.ep_size={experts.ep_size}")
        self.module.load_state_dict(saved["module"], strict=False)
        if self.optimizer is None:
            return
        if module_only or saved["optimizer"] is None:
            self.optimizer.refresh_masters_from_params()  # they were refreshed from rank 0's experts
        else:
            self.optimizer.load_expert_state_dict(saved["optimizer"], load_optimizer_states=load_optimizer_states)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None
                        ) -> tuple[str | None, dict | None]:
        """Restore a checkpoint written by :meth:`save_checkpoint`.

        Returns:
            ``(path, client_state)``, or ``(None, None)`` when ``load_dir`` holds no checkpoint.
        """
        path = checkpoint.resolve(load_dir, tag)
        if path is None:
            logger.warning("no checkpoint to load in %s (no 'latest' file)", load_dir)
            return None, None
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported")
        model_states = checkpoint.load_file(path / checkpoint.MODEL_FILE)
        saved_ep, ep_size = model_states.get("ep_size", 1), self.experts.ep_size if self.experts else 1
        if saved_ep != ep_size:
            raise CheckpointError(f"{path} was saved with moe.ep_size={saved_ep} and this run has {ep_size}: its experts "
                                  "are split differently. Resume with the same ep_size, or export it with `python -m "
                                  "angelptm.export` and load the weights into the model built with ep_size 1")
        has_optimizer_file = (path / checkpoint.OPTIM_FILE).is_file()
        module_weights = self._load_module_state(path, model_states, strict=load_module_strict,
                                                 has_optimizer_file=has_optimizer_file)
        optim_states = None
        if self.optimizer is not None and has_optimizer_file:
            optim_states = checkpoint.load_file(path / checkpoint.OPTIM_FILE)
            shards = model_states.get("zero_cache_shards", 1)
            if shards > 1:  # any world size loads it: each rank takes the names it owns now
                checkpoint.merge_zero_cache_shards(path, optim_states["optimizer"], shards)
            # fp32 masters are the exact weights; the module's copy is rounded to the compute dtype.
            self.optimizer.load_state_dict(optim_states["optimizer"],
                                           load_optimizer_states=load_optimizer_states and not load_module_only)
        elif self.optimizer is not None and module_weights:  # sharded params: the shards take them from the masters
            self.optimizer.load_master_state_dict(module_weights)
        elif self.optimizer is not None:
            self.optimizer.refresh_masters_from_params()
        self._load_expert_slice(path, load_optimizer_states=load_optimizer_states and not load_module_only,
                                module_only=optim_states is None)
        if load_module_only:
            return str(path), model_states["client_state"]
        if load_lr_scheduler_states and self.lr_scheduler is not None and optim_states is not None:
            self.lr_scheduler.load_state_dict(optim_states["lr_scheduler"])
        for name in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            setattr(self, name, model_states[name])
        self._restore_rank_state(path, model_states["world_size"])
        return str(path), model_states["client_state"]

    def _sharded_weight_keys(self, aliases: dict[str, str]) -> set[str]:
        """State-dict keys of the weights this run keeps only as ZeRO-Cache shards (none when params are replicated)."""
        if not getattr(self.optimizer, "params_sharded", False):
            return set()
        held = set(self.optimizer.names)
        return {key for key, name in aliases.items() if name in held}

    def _load_module_state(self, path: Path, model_states: dict, *, strict: bool,
                           has_optimizer_file: bool) -> dict[str, torch.Tensor]:
        """Load the module's state, except weights this run holds sharded, or a sharded run saved in its masters.

        Returns:
            The saved weights of the sharded params by parameter name (fp32), for the masters when there
            are no optimizer states to take them from; otherwise empty.
        """
        state = model_states["module"]
        aliases = self._param_aliases()
        held, in_masters = self._sharded_weight_keys(aliases), model_states.get("weights_in_masters", False)
        if not held and not in_masters:
            self.module.load_state_dict(state, strict=strict)
            return {}
        if in_masters and (self.optimizer is None or not has_optimizer_file):
            raise CheckpointError(f"{path} was saved with ZeRO-Cache's params sharded: its weights are the fp32 masters "
                                  f"in {checkpoint.OPTIM_FILE}, which this load cannot use (it is missing, or the "
                                  "engine has no optimizer). Export it with `python -m angelptm.export` and load the "
                                  "weights into the model instead")
        weights = {aliases[key]: tensor.float() for key, tensor in state.items() if key in held}
        result = self.module.load_state_dict({k: v for k, v in state.items() if k not in held}, strict=False)
        saved_weights = set(model_states["param_aliases"]) if in_masters else set()
        missing = set(result.missing_keys) - held - saved_weights
        if strict and (missing or result.unexpected_keys):
            raise CheckpointError(f"{path}: the module state does not match the model: missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(result.unexpected_keys)[:5]}")
        return weights

    def _restore_rank_state(self, path: Path, saved_world_size: int) -> None:
        rank_path = path / checkpoint.rank_file(self.ctx.rank)
        if saved_world_size != self.world_size or not rank_path.is_file():
            # Per-rank RNG streams cannot carry over to another world size; the data position can,
            # as a count of samples consumed by all ranks together.
            logger.warning("checkpoint was saved with %d ranks, now %d: RNG streams start fresh, data resumes "
                           "after %d samples", saved_world_size, self.world_size, self.global_samples)
            if self.training_dataloader is not None:
                self.training_dataloader.seek(self.global_samples)
            return
        per_rank = checkpoint.load_file(rank_path)
        checkpoint.restore_rng_state(per_rank["rng"])
        if self.training_dataloader is not None and per_rank["data"] is not None:
            self.training_dataloader.load_state_dict(per_rank["data"])

    def save_fp32_model(self, path: str) -> None:
        """Write the consolidated fp32 weights to one safetensors file (rank 0; every rank calls it)."""
        from safetensors.torch import save_file

        if self.ctx.is_main or self.zero_cache_shards > 1:
            state = self.consolidated_state_dict()  # a collective when the masters are sharded
            if self.ctx.is_main:
                save_file(state, path)
        self.ctx.barrier()

    def _sync_params(self) -> None:
        """Bring every rank's param chunks up to date (sharded ZeRO-Cache; a collective)."""
        if self.zero_cache_shards > 1:
            self.optimizer.sync_params()

