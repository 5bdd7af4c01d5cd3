"""The AutoPipe steps both pipeline engines take: DeepSpeed's ``PipelineEngine`` (:mod:`angelptm.pipe.engine`) and
``pretrain.py``'s AutoPipe job (:mod:`angelptm.pretraining.pipeline_parallel`).

Rank 0's op profile shared with every rank (:func:`shared_profile`), the split searched from it
(:func:`plan`, the same on every rank), and the accumulated gradients reduced over the pipeline's groups and
clipped by the global norm (:func:`reduce_and_clip`).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist

from angelptm.config import EngineConfig
from angelptm.engine.mixed_precision import MixedPrecisionOptimizer
from angelptm.errors import ConfigError
from angelptm.launch.distributed import DistContext
from autopipe.cost import CostSettings
from autopipe.profile import Profile
from autopipe.profiler import profile_graph
from autopipe.runtime import PipelineRunner
from autopipe.search import PlanReport, plan_with_baselines

logger = logging.getLogger(__name__)


def shared_profile(cfg: EngineConfig, graph, example: dict[str, torch.Tensor], ctx: DistContext) -> Profile:
    """Rank 0's profile (measured, or read from ``autopipe.profile_path``) on every rank."""
    ap = cfg.autopipe
    if ap.profile_path is not None:
        try:
            profile = Profile.load(ap.profile_path)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    else:
        holder = [None]
        if ctx.is_main:
            logger.info("profiling %d ops (warm-up %d, repeats %d)", len(graph.ops), ap.profile_warmup,
                        ap.profile_repeats)
            holder = [profile_graph(graph, example, warmup=ap.profile_warmup, repeats=ap.profile_repeats).to_json()]
        if ctx.group is not None:
            dist.broadcast_object_list(holder, src=0, group=ctx.group)
        profile = Profile.from_json(holder[0])
    shapes = {name: list(tensor.shape) for name, tensor in example.items()}
    if profile.input_shapes != shapes:
        raise ConfigError(f"autopipe.profile_path={ap.profile_path!r} was measured with inputs {profile.input_shapes}; "
                          f"this run's micro-batch is {shapes}; profile again at this micro-batch size")
    names = [node.name for node in graph.ops]
    if profile.op_names != names:
        raise ConfigError(f"autopipe.profile_path={ap.profile_path!r} was recorded for another graph "
                          f"({len(profile.ops)} ops, this model has {len(names)}); profile this model and micro-batch "
                          "size again")
    return profile


def plan(cfg: EngineConfig, profile: Profile, device: torch.device) -> tuple[PlanReport, list[int]]:
    """Search the split; returns the report and the first op of each chunk."""
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    settings = CostSettings.from_config(cfg.autopipe, memory_limit_bytes=capacity)
    if cfg.model.activation_checkpointing:
        settings = dataclasses.replace(settings, recompute=True)
    try:
        report = plan_with_baselines(profile.to_chain(cfg.autopipe.max_cut_tensors), settings)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    units = profile.unit_op_starts(cfg.autopipe.max_cut_tensors)
    return report, [units[u] for u in report.auto.stage_starts]


def reduce_and_clip(runner: PipelineRunner, optimizer: MixedPrecisionOptimizer, clip: float) -> float:
    """Data-parallel mean, tied-gradient sum, global norm and clipping of the accumulated fp32 gradients.

    Returns:
        The global gradient norm before clipping (non-finite: the caller skips the step on every rank).
    """
    optimizer.collect_gradients()
    flat = optimizer.flat_grad
    if runner.layout.num_replicas > 1:
        flat.mul_(1.0 / runner.layout.num_replicas)
        dist.all_reduce(flat, group=runner.data_parallel_group)
    # By parameter, not name: the optimizer may name parameters after the user's module, the runner after its graph.
    views = {id(param): view for param, view in zip(optimizer.params, optimizer.grad_views)}
    runner.sync_tied_gradients(lambda _, param: views[id(param)])
    square = torch.linalg.vector_norm(flat).square()
    named = dict(runner.named_parameters())
    for name in runner.duplicate_parameter_names:  # held (and counted) by a lower stage rank too
        square = square - torch.linalg.vector_norm(views[id(named[name])]).square()
    if runner.pipeline_group is not None:
        dist.all_reduce(square, group=runner.pipeline_group)
    norm = math.sqrt(max(square.item(), 0.0)) if math.isfinite(square.item()) else math.inf
    if clip > 0 and math.isfinite(norm) and norm > clip:
        flat.mul_(clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
    return norm
