"""The pipeline engine: ``engine.train_batch()`` / ``eval_batch()`` of a :class:`PipelineModule` on AutoPipe's runtime.

At the first batch (or at ``initialize`` when ``training_data`` is given) every rank traces the whole
module with its loss (``autopipe.graph.trace``), each layer through a ``slots.<i>`` module, and cuts the
op graph where the module's layer partition starts each stage (:func:`angelptm.pipe.partition.layer_op_starts`),
or, for ``partition_method="autopipe"``, where AutoPipe's search over rank 0's op profile says
(:func:`angelptm.pipe.autopipe_steps.shared_profile` and :func:`angelptm.pipe.autopipe_steps.plan`). The rank
then runs its stage with :class:`autopipe.runtime.PipelineRunner` (``torch.distributed.pipelining``; 1F1B, or
GPipe when there are fewer micro-batches than stages).

One ``train_batch`` = DeepSpeed's: ``gradient_accumulation_steps`` micro-batches through the pipeline, the
gradients of their mean loss reduced over data-parallel replicas and tied stages and clipped by the global
norm (:func:`angelptm.pipe.autopipe_steps.reduce_and_clip`), one optimizer and scheduler step; it
returns the mean loss on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from angelptm.config import EngineConfig, load_config
from angelptm.engine.builders import (
    build_optimizer,
    listed_parameters,
    pick_config,
    place_module,
    report_config,
    resolve_scheduler,
)
from angelptm.engine.engine import Engine
from angelptm.errors import ConfigError
from angelptm.launch.distributed import init_distributed
from angelptm.pipe import autopipe_steps
from angelptm.pipe.checkpoint import PipelineCheckpoints
from angelptm.pipe.module import PipelineError, PipelineModule
from angelptm.pipe.partition import SLOT_PREFIX, layer_op_starts
from angelptm.pretraining.data.loader import ResumableDataLoader, repeat_batches
from angelptm.runtime.utils import set_random_seed
from autopipe.graph import trace
from autopipe.runtime import PipelineLayout, PipelineRunner

logger = logging.getLogger(__name__)
TARGET = "labels"


class _Slot(nn.Module):
    """Calls one layer; has no parameters of its own, so the traced ops record which layer they came from."""

    def __init__(self, function: Callable) -> None:
        super().__init__()
        self._function = [function]  # in a list: the layer stays registered under the PipelineModule only

    def forward(self, x: Any) -> Any:
        return self._function[0](x)


class _Traced(nn.Module):
    """The PipelineModule and its loss as one module: ``(input_0, ..., labels) -> loss``."""

    def __init__(self, module: PipelineModule) -> None:
        super().__init__()
        self.module = module
        self.add_module(SLOT_PREFIX, nn.ModuleList(_Slot(f) for f in module.forward_funcs))

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        labels = inputs.pop(TARGET)
        values = [inputs[f"input_{i}"] for i in range(len(inputs))]
        x = values[0] if len(values) == 1 else tuple(values)
        for slot in getattr(self, SLOT_PREFIX):
            x = slot(x)
        return self.module.loss_fn(x, labels)


def _split(batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A DeepSpeed pipeline batch ``(inputs, labels)`` as (input tensors, label tensor)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise PipelineError(f"a pipeline batch must be (inputs, labels), got {type(batch).__name__}")
    inputs, labels = batch
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not isinstance(labels, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise NotImplementedError("pipeline batches here are (tensor or tuple of tensors, one label tensor); "
                                  "a tuple of labels is not supported: pack it into one tensor")
    return inputs, labels


class PipelineEngine(PipelineCheckpoints, Engine):
    """What :func:`angelptm.initialize` returns for a :class:`PipelineModule`; train with :meth:`train_batch`.

    Args:
        module: the pipeline module, on the device in the compute dtype.
        config: the typed config (batch sizes resolved for world / num_stages replicas).
        ctx: this rank.
        optimizer: over this rank's stage parameters, fp32 masters; no reduction or clipping of its own.
        lr_scheduler: stepped after every optimizer step.
        training_dataloader: the loader of ``training_data`` (micro-batches of this replica), or None.
    """

    def __init__(self, module: PipelineModule, config: EngineConfig, ctx: Any, optimizer: Any, lr_scheduler: Any,
                 training_dataloader: ResumableDataLoader | None) -> None:
        super().__init__(module, config, ctx, optimizer, lr_scheduler, training_dataloader)
        self.layout = PipelineLayout(world_size=ctx.world_size, num_stages=module.num_stages)
        self.micro_batches = config.batch.gradient_accumulation_steps
        self.runner: PipelineRunner | None = None
        self.data_iterator: Iterator | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self._train_batch_s = 0.0  # seconds in train_batch() since the last steps_per_print line (DeepSpeed's timer)

    # ------------------------------------------------------------------ DeepSpeed's pipeline accessors
    @property
    def stage_id(self) -> int:
        return self.ctx.rank % self.layout.num_stages

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def dp_world_size(self) -> int:
        return self.layout.num_replicas

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.layout.num_stages - 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator :meth:`train_batch` reads when called without one."""
        self.data_iterator = iterator

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def save_16bit_model(self, *args: Any, **kwargs: Any) -> bool:
        raise NotImplementedError("PipelineEngine.save_16bit_model() is not built: each rank holds only its stage "
                                  "(DeepSpeed's pipeline engine writes per-layer files there). Use save_checkpoint() "
                                  "and load the stages back into a PipelineModule of the same layout")

    # ------------------------------------------------------------------ batches
    def _next_flush(self, data_iter: Iterator | None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor] | None:
        """``micro_batches`` micro-batches joined along dim 0 (first and last stage only, as DeepSpeed loads)."""
        if not (self.is_first_stage() or self.is_last_stage()):
            return None
        if data_iter is not None:
            self.data_iterator = data_iter
        if self.data_iterator is None:
            if self.training_dataloader is None:
                raise PipelineError("train_batch() needs data_iter, or training_data= in initialize()")
            self.data_iterator = repeat_batches(self.training_dataloader)
        batches = [_split(next(self.data_iterator)) for _ in range(self.micro_batches)]
        inputs = tuple(torch.cat(parts) for parts in zip(*(b[0] for b in batches)))
        return inputs, torch.cat([b[1] for b in batches])

    def _example(self, flush: tuple | None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Rank 0's first micro-batch on every rank: all trace the same shapes."""
        holder = [None]
        if self.ctx.rank == 0:
            if flush is None:
                raise PipelineError("rank 0 has no data: pass data_iter to train_batch() on the first stage")
            size = flush[1].shape[0] // self.micro_batches
            holder = [(tuple(t[:size].cpu() for t in flush[0]), flush[1][:size].cpu())]
        if self.ctx.group is not None:
            dist.broadcast_object_list(holder, src=0, group=self.ctx.group)
        return holder[0]

    def _device_inputs(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> dict[str, torch.Tensor]:
        named = {f"input_{i}": t.to(self.device, self.compute_dtype if t.is_floating_point() else t.dtype)
                 for i, t in enumerate(inputs)}
        return {**named, TARGET: labels.to(self.device)}

    # ------------------------------------------------------------------ the runner
    def build_runner(self, example: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> PipelineRunner:
        """Trace the module at ``example``'s shapes, cut it into stages and build this rank's (every rank calls it).

        Raises:
            ConfigError: a layer boundary that cannot be cut, or AutoPipe's search found no split.
        """
        inputs = self._device_inputs(*example)
        self.module.train()  # the stages run this graph for training: trace it in training mode
        graph = trace(_Traced(self.module), inputs, TARGET)
        gas, stages = self.micro_batches, self.layout.num_stages
        schedule = "1f1b" if gas >= stages else "gpipe"
        if self.module.parts is None:
            op_starts = self._autopipe_split(graph, inputs, schedule)
        else:
            try:
                op_starts = layer_op_starts(graph, self.module.parts)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        self.runner = PipelineRunner(graph, op_starts, self.layout, self.ctx.rank, self.device, schedule=schedule,
                                     num_microbatches=gas, loss_scale=1.0 / gas,
                                     recompute=self.module.activation_checkpoint_interval > 0)
        if self.optimizer is not None:
            held = {id(p) for p in self.optimizer.params}
            missing = [name for name, p in self.runner.named_parameters() if p.requires_grad and id(p) not in held]
            if missing:
                raise ConfigError(f"pipeline stage {self.stage_id} reads trainable parameters {missing[:3]} that are "
                                  "not among its layers' parameters given to the optimizer: share a module between "
                                  "stages with TiedLayerSpec, and pass every trainable parameter in model_parameters")
        return self.runner

    def _autopipe_split(self, graph: Any, inputs: dict[str, torch.Tensor], schedule: str) -> list[int]:
        """AutoPipe's op-level split: rank 0's profile, the search every rank runs the same way."""
        autopipe = dataclasses.replace(self.config.autopipe, num_stages=self.layout.num_stages,
                                       num_microbatches=self.micro_batches, schedule=schedule,
                                       virtual_stages_per_rank=1)
        cfg = dataclasses.replace(self.config, autopipe=autopipe)
        profile = autopipe_steps.shared_profile(cfg, graph, inputs, self.ctx)
        report, op_starts = autopipe_steps.plan(cfg, profile, self.device)
        if self.ctx.is_main:
            logger.info("AutoPipe split of the PipelineModule (%d stages, %d micro-batches):\n%s",
                        self.layout.num_stages, self.micro_batches, report.format())
        return op_starts

    # ------------------------------------------------------------------ train / eval
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches (DeepSpeed's ``train_batch``).

        Args:
            data_iter: yields ``(inputs, labels)`` micro-batches; read on the first and last stage only.
                None: the one given before, or the loader of ``training_data``.

        Returns:
            The mean loss of the micro-batches (averaged over replicas), on every rank.
        """
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() cannot be called with torch.no_grad(); use eval_batch()")
        started_s = time.perf_counter()
        flush = self._next_flush(data_iter)
        runner = self.runner or self.build_runner(self._example(flush))
        with self.optimizer.accumulating():
            loss = runner.step(*self._runner_arguments(flush), backward=True)
        norm = autopipe_steps.reduce_and_clip(runner, self.optimizer, self.config.gradient_clipping)
        self._step_applied = math.isfinite(norm)
        if self._step_applied:
            self.optimizer.step()
            self.optimizer.last_grad_norm = norm
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.optimizer.zero_grad()
            self.skipped_steps += 1
            logger.warning("step %d: non-finite gradient norm; update skipped on every rank", self.global_steps + 1)
        self.global_steps += 1
        self.micro_steps += self.micro_batches
        self.global_samples += self.train_batch_size()
        self.agg_train_loss = self._pipe_scalar(loss)
        self._train_batch_s += time.perf_counter() - started_s
        if self.global_steps % self.config.monitor.steps_per_print == 0:
            if self.ctx.is_main:
                self._print_progress()
            self._train_batch_s = 0.0
        return self.agg_train_loss

    def _print_progress(self) -> None:
        """DeepSpeed's pipeline line (its ``train_batch`` prints it on rank 0): loss, mean step time, samples/s."""
        iter_time_s = self._train_batch_s / self.config.monitor.steps_per_print
        logger.info("steps: %d loss: %.4f iter time (s): %.3f samples/sec: %.3f", self.global_steps,
                    self.agg_train_loss.item(), iter_time_s, self.train_batch_size() / max(iter_time_s, 1e-9))

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> torch.Tensor:
        """Forward ``gradient_accumulation_steps`` micro-batches; their mean loss (DeepSpeed's ``eval_batch``).

        Args:
            data_iter: yields ``(inputs, labels)`` micro-batches.
            return_logits, compute_loss, reduce_output, num_micro_batches: only DeepSpeed's defaults are
                supported (the stages are traced with the loss, for ``gradient_accumulation_steps``
                micro-batches); others raise.
            bcast_loss: True returns the loss on every rank; False only on the last stage (None elsewhere).

        Returns:
            The mean loss.
        """
        if return_logits or not compute_loss or reduce_output != "avg" or \
                num_micro_batches not in (None, self.micro_batches):
            raise NotImplementedError("eval_batch: only return_logits=False, compute_loss=True, reduce_output='avg' "
                                      "and gradient_accumulation_steps micro-batches are supported (stages are traced "
                                      "with the loss); evaluate logits with the module outside the pipeline")
        self._check_eval_matches_trace()
        saved, self.data_iterator = self.data_iterator, None
        try:
            flush = self._next_flush(data_iter)
        finally:
            self.data_iterator = saved
        runner = self.runner or self.build_runner(self._example(flush))
        with torch.no_grad():
            loss = runner.step(*self._runner_arguments(flush), backward=False)
        if not bcast_loss:
            return loss
        return self._pipe_scalar(loss)

    def _check_eval_matches_trace(self) -> None:
        """The stages run the graph traced for training: refuse layers whose evaluation differs from it."""
        differing = sorted({type(m).__name__ for m in self.module.modules()
                            if isinstance(m, nn.modules.batchnorm._BatchNorm)
                            or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)})
        if differing:
            raise NotImplementedError(f"eval_batch: the pipeline runs the graph traced in training mode, and "
                                      f"{', '.join(differing)} behave differently in evaluation; evaluate the module "
                                      "outside the pipeline, or set dropout to 0 / use LayerNorm")

    def _runner_arguments(self, flush: tuple | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if flush is None:  # a middle stage: the runner reads neither
            return {}, torch.empty(0)
        named = self._device_inputs(*flush)
        return named, named.pop(TARGET)

    def _pipe_scalar(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss, averaged over replicas, on every rank of the pipeline."""
        runner = self.runner
        value = loss.float().clone() if loss is not None else torch.zeros((), device=self.device)
        if self.is_last_stage() and runner.layout.num_replicas > 1:
            dist.all_reduce(value, group=runner.data_parallel_group)
            value /= runner.layout.num_replicas
        if runner.pipeline_group is not None:
            replica = self.ctx.rank // self.layout.num_stages
            dist.broadcast(value, src=self.layout.global_rank(replica, self.layout.num_stages - 1),
                           group=runner.pipeline_group)
        return value


def _local_parameters(module: PipelineModule, model_parameters: Iterable | None, local: set[int]) -> list:
    """``model_parameters`` (tensors or group dicts) restricted to this rank's stage."""
    given = list(model_parameters) if model_parameters is not None else [p for p in module.parameters()
                                                                         if p.requires_grad]
    if given and isinstance(given[0], dict):
        return [{**group, "params": [p for p in group["params"] if id(p) in local]} for group in given]
    return [p for p in given if id(p) in local]


def initialize_pipeline(args: Any, model: PipelineModule, optimizer: Any, model_parameters: Iterable | None,
                        training_data: Any, lr_scheduler: Any, dist_init_required: bool | None, collate_fn: Any,
                        config: Any, config_params: Any) -> tuple[PipelineEngine, Any, Any, Any]:
    """:func:`angelptm.initialize` for a :class:`PipelineModule` (same arguments and return value).

    Raises:
        ConfigError: fp16 (no loss scaling on the pipeline path), ZeRO stage 2/3 or ZeRO-Cache (as in
            DeepSpeed, pipelines keep gradients whole), "autopipe" partitioning without ``training_data``.
    """
    ctx = init_distributed(dist_init_required=dist_init_required)
    if ctx.world_size != model.world_size:
        raise ConfigError(f"the PipelineModule was built for {model.world_size} ranks and this run has "
                          f"{ctx.world_size}; call init_distributed() before building it")
    replicas = ctx.world_size // model.num_stages
    config = pick_config(args, config, config_params)
    cfg = config if isinstance(config, EngineConfig) else load_config(config, world_size=replicas)
    if cfg.precision.loss_scale is not None:
        raise ConfigError("a PipelineModule with fp16: the pipeline path has no loss scaling; use bf16")
    if cfg.precision.autocast_dtype is not None:
        raise ConfigError("a PipelineModule with torch_autocast: the pipeline's stages do not run under torch.autocast "
                          "here; remove the torch_autocast section and write \"bf16\": {\"enabled\": true}")
    if cfg.zero.stage >= 2 or cfg.zero_cache.enabled:
        raise ConfigError("a PipelineModule with ZeRO stage 2/3 or zero_cache: pipeline parallelism keeps gradients "
                          "whole (DeepSpeed refuses ZeRO-2/3 with pipelines too); use stage 0 or 1")
    model_parameters = listed_parameters(model, optimizer, model_parameters, cfg)  # before it is cut to this stage
    report_config(cfg, ctx)
    if cfg.seed is not None:
        set_random_seed(cfg.seed)
    place_module(model, ctx.device, cfg.precision.dtype, keep_trainable=False)
    loader = None
    if training_data is not None:
        loader = ResumableDataLoader(training_data, cfg.batch.micro_batch_size, rank=ctx.rank // model.num_stages,
                                     world_size=replicas, shuffle=cfg.data.shuffle, seed=cfg.seed or 0,
                                     reshuffle_each_epoch=cfg.data.reshuffle_each_epoch,
                                     num_workers=cfg.data.num_workers, collate_fn=collate_fn)
    engine = PipelineEngine(model, cfg, ctx, None, None, loader)
    if model.parts is None:  # autopipe: the split (and so this rank's parameters) needs a batch now
        if training_data is None:
            raise ConfigError("partition_method='autopipe' profiles a micro-batch at initialize(): pass "
                              "training_data=, or use partition_method='parameters'")
        collate = collate_fn or default_collate
        example = _split(collate([training_data[i] for i in range(cfg.batch.micro_batch_size)]))
        local = {id(p) for _, p in engine.build_runner(example).named_parameters()}
    else:
        local = {id(p) for p in model.stage_parameters(engine.stage_id)}
    if isinstance(optimizer, torch.optim.Optimizer):  # built over the whole module: keep this stage's part
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in local]
    # The runner reduces and clips (reduce_and_clip): the optimizer itself neither all-reduces nor clips.
    alone = dataclasses.replace(ctx, group=None)
    wrapped = build_optimizer(model, optimizer, _local_parameters(model, model_parameters, local),
                              dataclasses.replace(cfg, gradient_clipping=0.0), alone)
    if wrapped is None:
        raise ConfigError("a PipelineModule trains with train_batch(): add an \"optimizer\" section or pass optimizer=")
    engine.optimizer, engine.lr_scheduler = wrapped, resolve_scheduler(lr_scheduler, wrapped, cfg)
    return engine, wrapped, loader, engine.lr_scheduler
