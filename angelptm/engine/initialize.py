"""``angelptm.initialize``: DeepSpeed's entry point, same signature, same return value."""

from __future__ import annotations

import logging
import random
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import zero_cache

from angelptm.engine import gathered_params
from angelptm.config import EngineConfig, load_config
from angelptm.engine.cpu_bf16 import slow_bf16_warning
from angelptm.pretraining.data.loader import ResumableDataLoader
from angelptm.launch.distributed import DistContext, init_distributed, launcher_world_size
from angelptm.engine.engine import Engine
from angelptm.errors import ConfigError
from angelptm.engine.expert_parallel import ExpertParallel, setup_expert_parallel
from angelptm.memory.fit_check import check_shapes_fit
from angelptm.launch.log_output import set_log_level, show_logs_in_plain_script
from angelptm.engine.loss_scaler import LossScaler
from angelptm.engine.mixed_precision import MixedPrecisionOptimizer
from angelptm.pipe.module import PipelineModule
from angelptm.engine.schedulers import build_scheduler

logger = logging.getLogger(__name__)


def initialize(args: Any = None, model: nn.Module | None = None,
               optimizer: torch.optim.Optimizer | Callable[[Iterable], torch.optim.Optimizer] | None = None,
               model_parameters: Iterable | None = None, training_data: torch.utils.data.Dataset | None = None,
               lr_scheduler: Any = None, distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: str | dict | EngineConfig | None = None, mesh_param: Any = None,
               config_params: str | dict | None = None
               ) -> tuple[Engine, MixedPrecisionOptimizer | None, ResumableDataLoader | None, Any]:
    """Build the training engine, like ``deepspeed.initialize``.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` is used when ``config`` is not given.
        model: the ``nn.Module`` to train (required).
        optimizer: a torch optimizer over the model's parameters (no state yet), or a callable that
            builds one from parameters; overrides the config's "optimizer".
        model_parameters: parameters or param-group dicts for the config's optimizer (default: all
            trainable parameters of ``model``).
        training_data: a map-style Dataset; returns a resumable loader with the micro-batch size,
            sharded over data-parallel ranks.
        lr_scheduler: a scheduler object or a callable ``f(optimizer)``; overrides the config's.
        distributed_port, mpu, mesh_param: accepted for signature compatibility; model parallelism
            is not supported, so ``mpu`` / ``mesh_param`` must be None.
        dist_init_required: None = join a process group when the launcher started several ranks.
        collate_fn: batch collation for ``training_data``.
        config: a DeepSpeed JSON config, as a path or a dict (``config_params`` is an alias), or an
            :class:`EngineConfig` already loaded with :func:`load_config` (not parsed again).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``; items not requested are None.
    """
    show_logs_in_plain_script()  # the dtype, steps_per_print and pipeline loss lines, as DeepSpeed shows them
    if model is None:
        raise ConfigError("angelptm.initialize: model= is required")
    if mpu is not None or mesh_param is not None:
        raise ConfigError("angelptm.initialize: mpu/mesh_param (tensor or sequence parallelism) are not supported")
    if isinstance(model, PipelineModule):  # DeepSpeed's PipelineEngine: train_batch() on AutoPipe's runtime
        from angelptm.pipe.engine import initialize_pipeline  # it builds on this module's helpers

        return initialize_pipeline(args, model, optimizer, model_parameters, training_data, lr_scheduler,
                                   dist_init_required, collate_fn, config, config_params)
    config = _pick_config(args, config, config_params)
    # The config first: it holds the process group's timeout and heartbeat (comms).
    cfg = config if isinstance(config, EngineConfig) else load_config(config, world_size=launcher_world_size())
    ctx = init_distributed(dist_init_required=dist_init_required, timeout_s=cfg.comms.timeout_s,
                           lost_rank_after_s=cfg.comms.lost_rank_after_s)
    if cfg.batch.world_size != ctx.world_size:
        raise ConfigError(f"the config was resolved for {cfg.batch.world_size} ranks but this run has "
                          f"{ctx.world_size}; load it with load_config(..., world_size={ctx.world_size})")
    _report_ignored(cfg, ctx)
    if cfg.seed is not None:
        _seed_everything(cfg.seed)
    _refuse_deepspeed_partitioned(model)
    if model_parameters is not None:  # read twice: for the plan below and for the optimizer
        model_parameters = list(model_parameters)
    if cfg.zero_cache.enabled:  # fits or explains before the model is cast, moved or broadcast
        _check_fits(model, optimizer, model_parameters, cfg, ctx)
    _place_module(model, ctx.device, cfg.precision.dtype, keep_trainable=cfg.zero_cache.enabled)
    try:
        experts = setup_expert_parallel(model, ctx.rank, ctx.world_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _broadcast_module(model, ctx, experts)
    wrapped = _build_optimizer(model, optimizer, model_parameters, cfg, ctx, experts)
    if cfg.zero_cache.enabled:  # what did not go into a chunk (no optimizer, frozen, not in model_parameters)
        _place_module(model, ctx.device, cfg.precision.dtype, keep_trainable=False,
                      chunked=getattr(wrapped, "store", None))
    scheduler = _build_scheduler(lr_scheduler, wrapped, cfg)
    loader = None
    if training_data is not None:
        loader = ResumableDataLoader(training_data, cfg.batch.micro_batch_size, rank=ctx.rank,
                                     world_size=ctx.world_size, shuffle=cfg.data.shuffle, seed=cfg.seed or 0,
                                     num_workers=cfg.data.num_workers, collate_fn=collate_fn,
                                     pin_memory=ctx.device.type == "cuda")
    engine = Engine(model, cfg, ctx, wrapped, scheduler, loader, experts=experts)
    gathered_params.register(engine)  # zero.GatheredParameters finds the engine that owns a parameter
    return engine, wrapped, loader, scheduler


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


def _pick_config(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ConfigError("pass config= or config_params=, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise ConfigError("a config was given both as config= and as args.deepspeed_config; pass one")
    return config if config is not None else from_args


def _report_ignored(cfg: EngineConfig, ctx: DistContext) -> None:
    """Apply the config's ``log_level``; on rank 0, log the compute dtype and the keys that have no effect."""
    if cfg.monitor.log_level is not None:
        set_log_level(cfg.monitor.log_level)
    if not ctx.is_main:
        return
    report_precision(cfg)
    if cfg.accepted_not_acted:
        logger.warning("these config keys are accepted for DeepSpeed compatibility but have no effect here: %s",
                       ", ".join(cfg.accepted_not_acted))
    if cfg.zero.stage > 0 and not cfg.zero_cache.enabled:
        logger.warning("zero_optimization.stage=%d: model states are not partitioned yet (ZeRO-Cache is the planned "
                       "path); every rank holds a full replica", cfg.zero.stage)


def report_precision(cfg: EngineConfig) -> None:
    """One log line: the compute dtype and why; a warning, with the measured slowdown, for bf16 on a CPU
    without bf16 units."""
    precision = cfg.precision
    if precision.slow_bf16:
        logger.warning("%s", slow_bf16_warning(precision.reason))
    elif precision.reason:
        logger.info("compute dtype %s: %s", str(precision.dtype).removeprefix("torch."), precision.reason)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _refuse_deepspeed_partitioned(model: nn.Module) -> None:
    """Parameters that the real DeepSpeed's ``zero.Init`` partitioned hold an empty placeholder here, not weights.

    Raises:
        ConfigError: naming the parameters and the ways to build the model whole.
    """
    partitioned = [name for name, p in model.named_parameters() if hasattr(p, "ds_id")]
    if partitioned:
        raise ConfigError(
            f"parameters {partitioned[:3]}{' ...' if len(partitioned) > 3 else ''} were partitioned by the real "
            "DeepSpeed's zero.Init and hold no weights here. Build the model under angelptm.zero.Init (`import angelptm "
            "as deepspeed`); with transformers, import angelptm.integrations.transformers before the model is built "
            "(from_config / from_pretrained under a ZeRO-3 config then build on angelptm.zero), or build it before "
            "creating TrainingArguments / HfDeepSpeedConfig")


def _place_module(model: nn.Module, device: torch.device, dtype: torch.dtype, *, keep_trainable: bool,
                  chunked: Any = None) -> None:
    """Parameters and buffers to ``device``, floating ones in ``dtype``.

    ``keep_trainable`` (ZeRO-Cache): trainable parameters are cast where they are, so a model built on the
    host never lands whole on the GPU; each is copied into its chunk (on the device, or its home in host
    memory) when the optimizer attaches. ``chunked``: a :class:`~zero_cache.ChunkStore` whose parameters are
    left as they are.

    Raises:
        ConfigError: a parameter is on the meta device (it has no values to train from).
    """
    skip = {id(p) for p in chunked.params} if chunked is not None else set()
    meta = [name for name, p in model.named_parameters() if p.is_meta and id(p) not in skip]
    if meta:
        raise ConfigError(f"parameters {meta[:3]}{' ...' if len(meta) > 3 else ''} are on the meta device and hold "
                          "no values; build the model under angelptm.zero.Init(...) or on the CPU, or materialise it "
                          "(module.to_empty(device=...) and its initialisation) before initialize()")

    def place(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) in skip:
            return tensor
        stays = keep_trainable and isinstance(tensor, nn.Parameter) and tensor.requires_grad
        return tensor.to(device=tensor.device if stays else device,
                         dtype=dtype if tensor.is_floating_point() else tensor.dtype)

    # nn.Module.to's own traversal, with a per-tensor target: tied parameters stay one Parameter.
    model._apply(place)


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


def _build_optimizer(model: nn.Module, client: Any, model_parameters: Iterable | None, cfg: EngineConfig,
                     ctx: DistContext, experts: ExpertParallel | None = None) -> MixedPrecisionOptimizer | None:
    params = list(model_parameters) if model_parameters is not None else [p for p in model.parameters()
                                                                          if p.requires_grad]
    if isinstance(client, torch.optim.Optimizer):
        inner = client
    elif callable(client):
        inner = client(params)
    elif cfg.optimizer is not None:
        opt = cfg.optimizer
        cls = torch.optim.AdamW if opt.decoupled_weight_decay else torch.optim.Adam
        # On CUDA the fused kernel is torch's fastest Adam; on CPU the default foreach path.
        fused = True if ctx.device.type == "cuda" else None
        inner = cls(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                    amsgrad=opt.amsgrad, fused=fused)
    else:
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    scaler = LossScaler(cfg.precision.loss_scale) if cfg.precision.loss_scale is not None else None
    if cfg.zero_cache.enabled:
        if experts is not None:
            raise ConfigError("zero_cache with expert parallelism (moe.ep_size > 1) is not implemented yet; "
                              "set moe.ep_size to 1 or disable zero_cache")
        return _attach_zero_cache(model, inner, names, cfg, ctx, scaler)
    return MixedPrecisionOptimizer(inner, names, cfg.precision.dtype, loss_scaler=scaler,
                                   gradient_clipping=cfg.gradient_clipping, group=ctx.group,
                                   reduce_bucket_numel=cfg.zero.reduce_bucket_size, experts=experts)


def _attach_zero_cache(model: nn.Module, inner: torch.optim.Optimizer, names: dict[int, str], cfg: EngineConfig,
                       ctx: DistContext, scaler: LossScaler | None) -> zero_cache.ZeroCacheOptimizer:
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        raise ConfigError(f"zero_cache runs its own hybrid Adam and needs an Adam/AdamW optimizer, got "
                          f"{type(inner).__name__}")
    unsupported = [name for name in ("amsgrad", "maximize") if inner.defaults.get(name)]
    if unsupported:
        raise ConfigError(f"zero_cache's hybrid Adam does not implement {', '.join(unsupported)}; turn it off")
    decoupled = isinstance(inner, torch.optim.AdamW) or bool(inner.defaults.get("decoupled_weight_decay"))
    try:
        return zero_cache.attach(model, inner, names, cfg.zero_cache, compute_dtype=cfg.precision.dtype,
                                 device=ctx.device, decoupled_weight_decay=decoupled, loss_scaler=scaler,
                                 gradient_clipping=cfg.gradient_clipping,
                                 accumulation_steps=cfg.batch.gradient_accumulation_steps,
                                 sharding=_sharding(cfg, ctx))
    except (ValueError, NotImplementedError) as err:  # does not fit, chunk_size too small, or a feature not built
        raise ConfigError(str(err)) from None


def _sharding(cfg: EngineConfig, ctx: DistContext) -> zero_cache.Sharding:
    """This rank's share of the ZeRO-Cache chunks, with per-host groups when the collectives are hierarchical."""
    per_host = cfg.zero_cache.ranks_per_host or ctx.local_world_size
    hierarchical = cfg.zero_cache.hierarchical
    if hierarchical == "auto":
        hierarchical = ctx.world_size > per_host and ctx.world_size % per_host == 0
    if hierarchical and ctx.world_size % per_host:
        raise ConfigError(f"zero_cache.hierarchical needs whole hosts, but {ctx.world_size} ranks do not split into "
                          f"hosts of {per_host} (zero_cache.ranks_per_host / LOCAL_WORLD_SIZE)")
    hierarchical = bool(hierarchical) and ctx.world_size > 1
    host_group, peer_group = (zero_cache.hierarchical_groups(ctx.world_size, per_host) if hierarchical
                              else (None, None))
    stream = torch.cuda.Stream(ctx.device) if hierarchical and ctx.device.type == "cuda" else None
    return zero_cache.Sharding(rank=ctx.rank, world_size=ctx.world_size, group=ctx.group, ranks_per_host=per_host,
                               hierarchical=hierarchical, host_group=host_group, peer_group=peer_group,
                               side_stream=stream)


def _build_scheduler(client: Any, optimizer: MixedPrecisionOptimizer | None, cfg: EngineConfig) -> Any:
    if client is not None:
        if callable(client) and not hasattr(client, "step"):
            # Like DeepSpeed, hand the callable the inner torch optimizer (torch schedulers type-check it);
            # its param groups are the ones the engine steps.
            return client(optimizer.optimizer if optimizer is not None else None)
        return client
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError("the config has a \"scheduler\" but no optimizer to schedule")
    return build_scheduler(cfg.scheduler, optimizer)
