"""The training engine: DeepSpeed's engine API over a module, its mixed-precision optimizer and its data.

The engine orchestrates; the work lives in the pieces it holds: the optimizer (master weights, accumulation,
all-reduce, clipping), the schedule, the loader, and ``angelptm.checkpoints.files`` (atomic files). The optimizer is
:class:`~angelptm.engine.mixed_precision.MixedPrecisionOptimizer` or ZeRO-Cache's, behind the same calls:
:class:`~angelptm.engine.optimizer_contract.EngineOptimizer` lists them.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from angelptm.checkpoints.background import InFlightSave
from angelptm.checkpoints.engine_load import EngineLoads
from angelptm.checkpoints.engine_save import EngineSaves
from angelptm.config.typed import EngineConfig
from angelptm.engine.deepspeed_methods import DeepSpeedEngineMethods
from angelptm.engine.expert_parallel import ExpertParallel
from angelptm.engine.gathered_params import unregister
from angelptm.engine.optimizer_contract import EngineOptimizer
from angelptm.launch.distributed import DistContext
from angelptm.memory.oom import explained_oom
from angelptm.pretraining.data.loader import ResumableDataLoader
from angelptm.pretraining.health import RunHealth
from angelptm.telemetry.monitor import MetricsSink
from angelptm.telemetry.step_trace import StepTracer
from zero_cache import Timeline

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


class Engine(EngineSaves, EngineLoads, DeepSpeedEngineMethods, nn.Module):
    """What :func:`angelptm.initialize` returns first; call it like the module.

    Args:
        module: the model, already on ``ctx.device`` in the compute dtype.
        config: the typed config.
        ctx: this rank's distributed context.
        optimizer: the mixed-precision optimizer (replicated, or ZeRO-Cache's), or None for forward/backward only.
        lr_scheduler: an object with ``step()`` and ``state_dict()``, or None.
        training_dataloader: the loader built from ``training_data``, or None.
    """

    def __init__(self, module: nn.Module, config: EngineConfig, ctx: DistContext,
                 optimizer: EngineOptimizer | None, lr_scheduler: Any,
                 training_dataloader: ResumableDataLoader | None, experts: ExpertParallel | None = None) -> None:
        super().__init__()
        self.experts = experts  # expert-parallel layout (moe.ep_size > 1), with or without an optimizer
        self.module = module
        self.config = config
        self.ctx = ctx
        self.optimizer: EngineOptimizer | None = optimizer
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
        # Skipped steps go on as under DeepSpeed; the script gets a line when the run turns unhealthy and recovers.
        self._health = RunHealth(config.train.max_bad_steps)
        self._loss_nonfinite: torch.Tensor | None = None  # this step's micro-batch losses: any non-finite, on device
        self._destroyed = False
        self._save_dirs: set[str] = set()  # where save_checkpoint took the writer lock: destroy() gives it back
        self._in_flight = InFlightSave()  # a checkpoint written beside training (save_checkpoint(background=True))
        # ZeRO-Cache's timeline also records its copies, host jobs and disk requests; otherwise compute only.
        own_timeline = optimizer.timeline if optimizer is not None else None
        self._tracer = StepTracer(own_timeline or Timeline(ctx.device))

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
        """True when the next ``step()`` applies the optimizer (DeepSpeed's definition, or the value given to
        :meth:`set_gradient_accumulation_boundary`)."""
        return self._boundary_from_override((self.micro_steps + 1) % self.gradient_accumulation_steps() == 0)

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
        self._check_not_destroyed("forward")
        self._checkpoint_goes_on()
        start = self._clock()
        self._tracer.forward_starts()
        cast = self.compute_dtype if self.config.precision.cast_inputs else None
        args = _to_device(args, self.device, cast)
        kwargs = _to_device(kwargs, self.device, cast)
        with self._tracer.phase("forward"), explained_oom(self, "forward"), self._autocast():
            output = self.module(*args, **kwargs)
        self._tracer.forward_ended()
        self._timings["forward"] += self._clock() - start
        return output

    def _autocast(self) -> Any:
        """``torch_autocast``: the forward under ``torch.autocast`` in its dtype, over fp32 parameters (DeepSpeed's
        ``autocast_if_enabled``, which replaces an autocast the script entered around the call); else nothing."""
        dtype = self.config.precision.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(device_type=self.device.type, dtype=dtype)

    def trace_next_step(self, directory: str | Path) -> None:
        """Record the next step (its forward, backward and optimizer step, until the next forward has run) and
        write a Chrome/Perfetto trace and a PNG of it under ``directory`` (see :mod:`angelptm.telemetry.step_trace`)."""
        self._tracer.arm(directory, self.global_steps + 1)

    def finish_trace(self) -> list[Path]:
        """Write a trace still in progress (the run ends right after the traced step); returns the files."""
        return self._tracer.finish()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the fp16 loss scale).

        Gradients accumulate in fp32 inside the optimizer until the boundary ``step()``.

        Returns:
            The loss divided by the accumulation steps (with ``scale_wrt_gas``), as DeepSpeed does.
        """
        self._check_not_destroyed("backward")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        self._checkpoint_goes_on()
        start = self._clock()
        if self.optimizer is not None:
            self.optimizer.prepare_backward(self.is_gradient_accumulation_boundary())
        if scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps()
        nonfinite = ~torch.isfinite(loss.detach())  # no sync: read at step() only if the step was skipped
        self._loss_nonfinite = nonfinite if self._loss_nonfinite is None else self._loss_nonfinite | nonfinite
        scaled = loss.float() * self.loss_scale
        # The optimizer takes gradients out of .grad only inside the engine's backward: one of a backward
        # outside stays in .grad, where the script's zero_grad() reaches it, as under DeepSpeed.
        taking = self.optimizer.accumulating() if self.optimizer is not None else nullcontext()
        with self._tracer.phase("backward"), explained_oom(self, "backward"), taking:
            scaled.backward(retain_graph=retain_graph)
        if self.monitor is not None and self.monitor.enabled:
            detached = loss.detach().float() * (self.gradient_accumulation_steps() if scale_wrt_gas else 1)
            self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._timings["backward"] += self._clock() - start
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated so far (they live in the optimizer's fp32 buffers), and with them
        whether one of their losses was non-finite."""
        self._loss_nonfinite = None
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        self.module.zero_grad(set_to_none=set_to_none)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End a micro-step; at an accumulation boundary, update the weights and the schedule."""
        self._check_not_destroyed("step")
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: add an \"optimizer\" section to the config "
                               "or pass optimizer= to angelptm.initialize")
        self._checkpoint_goes_on(report=True)  # (a failed save in the background is raised here, before the step)
        self._step_applied = False
        self._check_step_outside_no_sync()
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        start = self._clock()
        scale_before = self.loss_scale
        with self._tracer.phase("optimizer step"), explained_oom(self, "optimizer step"):
            self._step_applied = self.optimizer.step()
        self._tracer.step_ended()
        if self._step_applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
            if self.ctx.is_main:
                change = ("" if self.optimizer.loss_scaler is None  # bf16/fp32: there is no scale to speak of
                          else f", loss scale lowered to {self.loss_scale:g}" if self.loss_scale != scale_before
                          else f", loss scale kept at {self.loss_scale:g} (hysteresis)")
                logger.warning("non-finite gradients (overflow) at step %d: step skipped%s",
                               self.global_steps + 1, change)
        self.micro_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._timings["step"] += self._clock() - start
        self._watch_health()
        if self.monitor is not None and self.monitor.enabled:
            self._write_monitor()
        if self.global_steps % self.config.monitor.steps_per_print == 0 and self.ctx.is_main:
            self._print_progress()

    def destroy(self) -> None:
        """DeepSpeed's: release now what the engine holds beyond the module. The optimizer's hooks come off, and
        its masters, states, buffers, swap files and worker thread are freed. The module keeps its current weights
        as ordinary tensors, so a new ``initialize()`` over it starts from them: accelerate's ``free_memory()``
        calls this, and transformers' ``Trainer.train()`` called again. A window between ``backward()`` and
        ``step()`` is dropped first (as ``zero_grad()`` drops it). ZeRO-Cache's gathered params (sharded or
        streamed) come back as whole copies in host memory (see :mod:`zero_cache.optim.release`).

        Afterwards the engine cannot run, train or checkpoint (the module itself can); a second call does nothing.
        Every rank calls it when ZeRO-Cache shards the states over ranks (unlike DeepSpeed's, it is a collective
        there: the ranks' weights are gathered)."""
        if self._destroyed:
            return
        try:
            self.wait_for_checkpoint()  # a save in the background is finished first (its error raised after)
        finally:
            if self.optimizer is not None:
                self.optimizer.destroy()
            self._release_save_dirs()
            unregister(self)
            self._loss_sum = None
            self._destroyed = True

    @property
    def destroyed(self) -> bool:
        """Whether :meth:`destroy` ran."""
        return self._destroyed

    def _check_not_destroyed(self, call: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"engine.{call}() after engine.destroy(): the engine released its optimizer; build a "
                               "new one with angelptm.initialize() over the module, which kept its weights")

    def _watch_health(self) -> None:
        """One warning line when ``train.max_bad_steps`` steps in a row were skipped or had a non-finite loss, one
        info line at the first healthy step after that; the run goes on. A non-finite loss makes non-finite
        gradients, which skip the step, so the loss flag is read (a device sync) only for a skipped step."""
        nonfinite, self._loss_nonfinite = self._loss_nonfinite, None
        finite = self._step_applied or nonfinite is None or not bool(nonfinite.item())
        scaler = self.optimizer.loss_scaler if self.optimizer is not None else None
        # fp16's dynamic scaler skipping steps while it lowers its scale is not an unhealthy run.
        said = self._health.watch(self.global_steps, applied=self._step_applied, finite=finite,
                                  scale_search=not self._step_applied and scaler is not None and scaler.dynamic)
        if said is not None and self.ctx.is_main:
            logger.log(*said)

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
        line = f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, mom={self.get_mom()}"
        if self.config.monitor.wall_clock_breakdown:
            line += " | " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self._timings.items())
            self._timings = dict.fromkeys(self._timings, 0.0)
        logger.info(line)
