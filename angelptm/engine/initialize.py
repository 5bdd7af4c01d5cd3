"""``angelptm.initialize``: DeepSpeed's entry point, same signature, same return value."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from angelptm.config import EngineConfig, load_config
from angelptm.engine import gathered_params
from angelptm.engine.builders import (
    build_optimizer,
    check_arguments,
    listed_parameters,
    pick_config,
    place_module,
    report_config,
    resolve_scheduler,
)
from angelptm.engine.engine import Engine
from angelptm.engine.expert_parallel import ExpertParallel, setup_expert_parallel
from angelptm.engine.mixed_precision import MixedPrecisionOptimizer
from angelptm.errors import ConfigError
from angelptm.launch.distributed import DistContext, init_distributed, launcher_world_size
from angelptm.launch.log_output import show_logs_in_plain_script
from angelptm.memory.fit_check import check_shapes_fit
from angelptm.pipe.engine import initialize_pipeline
from angelptm.pipe.module import PipelineModule
from angelptm.pretraining.data.loader import ResumableDataLoader
from angelptm.runtime.utils import set_random_seed


def initialize(args: Any = None, model: nn.Module | None = None,
               optimizer: torch.optim.Optimizer | Callable[[Iterable], torch.optim.Optimizer] | None = None,
               model_parameters: Iterable | None = None, training_data: torch.utils.data.Dataset | None = None,
               lr_scheduler: Any = None, distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: str | dict | EngineConfig | None = None, mesh_param: Any = None,
               config_params: str | dict | None = None
               ) -> tuple[Engine, torch.optim.Optimizer | None, ResumableDataLoader | None, Any]:
    """Build the training engine, like ``deepspeed.initialize``.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` is used when ``config`` is not given.
        model: the ``nn.Module`` to train (required).
        optimizer: a torch optimizer over the model's parameters (no state yet), or a callable that
            builds one from parameters; overrides the config's "optimizer".
        model_parameters: parameters or param-group dicts for the config's optimizer (default: all
            trainable parameters of ``model``).
        training_data: a map-style Dataset; returns a loader of micro-batches sharded over data-parallel ranks,
            with DeepSpeed's epochs (the same order every epoch, each ``iter()`` from the epoch's start) and a
            position that ``save_checkpoint`` / ``load_checkpoint`` carry (``ResumableDataLoader``).
        lr_scheduler: a scheduler object or a callable ``f(optimizer)``; overrides the config's.
        distributed_port, mpu, mesh_param: accepted for signature compatibility; model parallelism
            is not supported, so ``mpu`` / ``mesh_param`` must be None.
        dist_init_required: None = join a process group when the launcher started several ranks.
        collate_fn: batch collation for ``training_data``.
        config: a DeepSpeed JSON config, as a path or a dict (``config_params`` is an alias), or an
            :class:`EngineConfig` already loaded with :func:`load_config` (not parsed again).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``; items not requested are None. The optimizer is
        DeepSpeed's choice: the client's own in an fp32 run without ZeRO, else the engine's wrapper.

    Raises:
        AssertionError: ``model`` is None (DeepSpeed's error type for it).
        ArgumentTypeError: an argument of a type it does not take (named, with what is allowed).
        ConfigError: an invalid config, or an optimizer that would hold no trainable parameter of ``model``.
    """
    show_logs_in_plain_script()  # the dtype, steps_per_print and pipeline loss lines, as DeepSpeed shows them
    if model is None:  # AssertionError, as DeepSpeed's initialize raises (scripts and tests catch that type)
        raise AssertionError("angelptm.initialize: model= is required (pass the nn.Module to train)")
    check_arguments(model, optimizer)
    if mpu is not None or mesh_param is not None:
        raise ConfigError("angelptm.initialize: mpu/mesh_param (tensor or sequence parallelism) are not supported")
    if isinstance(model, PipelineModule):  # DeepSpeed's PipelineEngine: train_batch() on AutoPipe's runtime
        return initialize_pipeline(args, model, optimizer, model_parameters, training_data, lr_scheduler,
                                   dist_init_required, collate_fn, config, config_params)
    config = pick_config(args, config, config_params)
    # The config first: it holds the process group's timeout and heartbeat (comms).
    cfg = config if isinstance(config, EngineConfig) else load_config(config, world_size=launcher_world_size())
    ctx = init_distributed(dist_init_required=dist_init_required, timeout_s=cfg.comms.timeout_s,
                           lost_rank_after_s=cfg.comms.lost_rank_after_s)
    if cfg.batch.world_size != ctx.world_size:
        raise ConfigError(f"the config was resolved for {cfg.batch.world_size} ranks but this run has "
                          f"{ctx.world_size}; load it with load_config(..., world_size={ctx.world_size})")
    report_config(cfg, ctx)
    if cfg.seed is not None:
        set_random_seed(cfg.seed)
    _refuse_deepspeed_partitioned(model)
    model_parameters = listed_parameters(model, optimizer, model_parameters, cfg)  # (read twice: plan, optimizer)
    if cfg.zero_cache.enabled:  # fits or explains before the model is cast, moved or broadcast
        _check_fits(model, optimizer, model_parameters, cfg, ctx)
    place_module(model, ctx.device, cfg.precision.dtype, keep_trainable=cfg.zero_cache.enabled)
    try:
        experts = setup_expert_parallel(model, ctx.rank, ctx.world_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _broadcast_module(model, ctx, experts)
    wrapped = build_optimizer(model, optimizer, model_parameters, cfg, ctx, experts)
    if cfg.zero_cache.enabled:  # what did not go into a chunk (no optimizer, frozen, not in model_parameters)
        place_module(model, ctx.device, cfg.precision.dtype, keep_trainable=False,
                     chunked=getattr(wrapped, "store", None))
    scheduler = resolve_scheduler(lr_scheduler, wrapped, cfg)
    loader = None
    if training_data is not None:
        loader = ResumableDataLoader(training_data, cfg.batch.micro_batch_size, rank=ctx.rank,
                                     world_size=ctx.world_size, shuffle=cfg.data.shuffle, seed=cfg.seed or 0,
                                     reshuffle_each_epoch=cfg.data.reshuffle_each_epoch,
                                     num_workers=cfg.data.num_workers, collate_fn=collate_fn,
                                     pin_memory=ctx.device.type == "cuda")
    engine = Engine(model, cfg, ctx, wrapped, scheduler, loader, experts=experts)
    gathered_params.register(engine)  # zero.GatheredParameters finds the engine that owns a parameter
    return engine, _returned_optimizer(wrapped, optimizer, cfg), loader, scheduler


def _returned_optimizer(wrapped: Any, client: Any, cfg: EngineConfig) -> Any:
    """What ``initialize`` hands back as the optimizer: DeepSpeed's choice.

    DeepSpeed returns the client's own optimizer (the one given, or the one its callable built) when it trains
    in fp32 without ZeRO, and its wrapper otherwise; scripts compare it with theirs (``ds_optimizer ==
    client_optimizer``). That optimizer's param groups are the ones the engine steps, so schedulers built on
    either see the same rates. ``engine.optimizer`` stays the engine's wrapper.
    """
    plain = (isinstance(wrapped, MixedPrecisionOptimizer) and client is not None and cfg.zero.stage == 0
             and cfg.precision.dtype == torch.float32 and cfg.precision.loss_scale is None)
    return wrapped.optimizer if plain else wrapped


def _check_fits(model: nn.Module, client: Any, model_parameters: list | None, cfg: EngineConfig,
                ctx: DistContext) -> None:
    """Plan ZeRO-Cache for the parameters the optimizer will hold, from their shapes, before touching them
    (``attach`` plans again, the final word, once they are cast; this one refuses before the first byte moves)."""
    if client is None and cfg.optimizer is None:
        return  # no optimizer: nothing goes into ZeRO-Cache
    if isinstance(client, torch.optim.Optimizer):
        chosen = [p for group in client.param_groups for p in group["params"]]
    elif model_parameters is not None:
        chosen = [p for item in model_parameters for p in (item["params"] if isinstance(item, dict) else [item])]
    else:
        chosen = list(model.parameters())
    ids = {id(p) for p in chosen if isinstance(p, torch.Tensor) and p.requires_grad}
    params = [(name, p) for name, p in model.named_parameters() if id(p) in ids and not p.is_meta]
    resident: dict[str, int] = {}
    for _, p in params:
        resident[p.device.type] = resident.get(p.device.type, 0) + p.numel() * p.element_size()
    numel = sum(p.numel() for _, p in params)
    check_shapes_fit([(name, tuple(p.shape)) for name, p in params], cfg, world_size=ctx.world_size,
                     ranks_per_host=cfg.zero_cache.ranks_per_host or ctx.local_world_size, device=ctx.device,
                     resident_bytes=resident, what=f"{type(model).__name__} of {numel / 1e6:.1f} M trainable params")


def _refuse_deepspeed_partitioned(model: nn.Module) -> None:
    """Parameters that the real DeepSpeed's ``zero.Init`` partitioned hold an empty placeholder here, not weights.

    Raises:
        ConfigError: naming the parameters and the ways to build the model whole.
    """
    partitioned = [name for name, p in model.named_parameters() if hasattr(p, "ds_id")]
    if partitioned:
        raise ConfigError(
            f"parameters {partitioned[:3]}{' ...' if len(partitioned) > 3 else ''} were partitioned by the real "
            "DeepSpeed's zero.Init and hold no weights here. Build the model under angelptm.zero.Init (`import "
            "angelptm as deepspeed`); with transformers, import angelptm.integrations.transformers before the model is "
            "built (from_config / from_pretrained under a ZeRO-3 config then build on angelptm.zero), or build it "
            "before creating TrainingArguments / HfDeepSpeedConfig")


def _broadcast_module(model: nn.Module, ctx: DistContext, experts: ExpertParallel | None) -> None:
    """Start every replica from rank 0's weights, as DDP does; experts from their expert-data-parallel source."""
    if ctx.group is None:
        return
    expert_ids = experts.expert_ids if experts is not None else frozenset()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) not in expert_ids:
                _broadcast(tensor, 0, ctx.group, ctx.device)
            elif experts.edp_group is not None:
                _broadcast(tensor, experts.edp_source, experts.edp_group, ctx.device)


def _broadcast(tensor: torch.Tensor, source: int, group: Any, device: torch.device) -> None:
    """``dist.broadcast`` of one tensor; a host tensor under NCCL goes through a device copy of itself."""
    if tensor.device == device or device.type != "cuda":
        dist.broadcast(tensor.data, src=source, group=group)
        return
    staged = tensor.data.to(device)
    dist.broadcast(staged, src=source, group=group)
    tensor.data.copy_(staged)


