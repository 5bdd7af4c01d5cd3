"""The steps of ``initialize()`` that both engines take: :func:`angelptm.initialize` and the pipeline engine's
:func:`angelptm.pipe.engine.initialize_pipeline` (choose the config, report it, place the module, build the
optimizer and the LR scheduler). Both import them from here, so neither imports the other's internals."""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

import torch
from torch import nn

import zero_cache
from angelptm.config import EngineConfig, precision_modes
from angelptm.engine import deepspeed_cpu_adam
from angelptm.engine.cpu_bf16 import slow_bf16_warning
from angelptm.engine.expert_parallel import ExpertParallel
from angelptm.engine.loss_scaler import LossScaler
from angelptm.engine.mixed_precision import MixedPrecisionOptimizer
from angelptm.engine.optimizer_contract import EngineOptimizer
from angelptm.engine.schedulers import build_scheduler
from angelptm.errors import ArgumentTypeError, ConfigError
from angelptm.integrations import deepspeed_alias
from angelptm.launch.distributed import DistContext
from angelptm.launch.log_output import set_log_level

logger = logging.getLogger(__name__)


def pick_config(args: Any, config: Any, config_params: Any) -> Any:
    """The one config ``initialize()`` was given: ``config=``, ``config_params=`` or the script's
    ``args.deepspeed_config`` (``args.deepscale_config``, DeepSpeed's deprecated alias, is moved onto it with a
    warning, as ``deepspeed.initialize`` does).

    Raises:
        ConfigError: more than one was given.
        ArgumentTypeError: the one given is not a path, a dict or an :class:`EngineConfig`.
    """
    if config is not None and config_params is not None:
        raise ConfigError("pass config= or config_params=, not both")
    name = "config" if config is not None else "config_params"
    config = config if config is not None else config_params
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated, use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise ConfigError("both --deepscale_config (its deprecated alias) and --deepspeed_config were given; "
                              "pass --deepspeed_config only")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise ConfigError("a config was given both as config= and as args.deepspeed_config; pass one")
    if config is None:
        name, config = "args.deepspeed_config", from_args
    if config is not None and not isinstance(config, (str, os.PathLike, dict, EngineConfig)):
        raise ArgumentTypeError(f"{name}: got {type(config).__name__} ({_shown(config)}); pass a path to a DeepSpeed "
                                "JSON config (str or os.PathLike), a dict of it, or an EngineConfig from load_config")
    return config


def check_arguments(model: Any, optimizer: Any) -> None:
    """``model`` and ``optimizer`` are of types ``initialize()`` takes.

    Raises:
        ArgumentTypeError: naming the argument, its type and what is allowed.
    """
    if not isinstance(model, nn.Module):
        hint = " (build the model first: angelptm does not load models by name)" if isinstance(model, str) else ""
        raise ArgumentTypeError(f"model: got {type(model).__name__} ({_shown(model)}); pass the torch.nn.Module to "
                                f"train{hint}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise ArgumentTypeError(f"optimizer: got {type(optimizer).__name__} ({_shown(optimizer)}); pass a "
                                "torch.optim.Optimizer over the model's parameters, a callable that builds one from "
                                "them, or None to use the config's \"optimizer\" section")


def listed_parameters(model: nn.Module, client: Any, model_parameters: Any, cfg: EngineConfig) -> list | None:
    """``model_parameters`` as a list (param-group dicts with their ``params`` listed too, so a generator is read
    once), after making sure the optimizer will hold at least one trainable parameter of ``model``.

    What the optimizer holds: the client optimizer's groups when it is an optimizer object, else
    ``model_parameters``, else every parameter of ``model``. Without an optimizer (neither the client's nor the
    config's) nothing is required: a frozen model serves inference. ``(name, parameter)`` pairs (what
    ``model.named_parameters()`` yields, and torch optimizers take) are listed without their names. With a client
    optimizer object, ``model_parameters`` is ignored (as DeepSpeed does), so it is not read or checked.

    Returns:
        The listed ``model_parameters``, or None when none was given or a client optimizer object ignores it.

    Raises:
        ArgumentTypeError: ``model_parameters`` is not an iterable of tensors and param-group dicts.
        ConfigError: the optimizer would hold no trainable parameter of the model, so nothing would ever train.
    """
    if isinstance(client, torch.optim.Optimizer):
        given = None  # the client's optimizer already holds its parameters; model_parameters is ignored
    else:
        given = _parameter_list(model_parameters)
    if client is None and cfg.optimizer is None:
        return given
    if isinstance(client, torch.optim.Optimizer):
        source, held = "the optimizer", [p for group in client.param_groups for p in group["params"]]
    elif given is not None:
        source = "model_parameters"
        held = [p for item in given for p in (item["params"] if isinstance(item, dict) else [item])]
    else:
        source, held = None, list(model.parameters())
    own = {id(p) for p in model.parameters()}
    if any(isinstance(p, torch.Tensor) and p.requires_grad and id(p) in own for p in held):
        return given
    model_name = type(model).__name__
    if source is None:
        what = f"{len(held)} tensors, all frozen" if held else "it has none"
        raise ConfigError(f"the model {model_name} has no trainable parameter ({what}: requires_grad=False), so the "
                          "optimizer would never change a weight. Unfreeze what should train (p.requires_grad_(True)) "
                          "before initialize(), or give no optimizer for inference")
    strangers = sum(1 for p in held if id(p) not in own)
    parts = [f"{strangers} not a parameter of {model_name}" if strangers else "",
             f"{len(held) - strangers} frozen (requires_grad=False)" if len(held) > strangers else ""]
    what = ", ".join(part for part in parts if part) if held else "it is empty"
    raise ConfigError(f"{source} holds no trainable parameter of the model ({what}), so nothing would ever train; "
                      "pass model.parameters(), or [p for p in model.parameters() if p.requires_grad]")


def _parameter_list(model_parameters: Any) -> list | None:
    if model_parameters is None:
        return None
    allowed = ("pass an iterable of the model's parameters, of (name, parameter) pairs or of param-group dicts, "
               "e.g. model.parameters() or model.named_parameters(), as a list")
    if isinstance(model_parameters, (torch.Tensor, str, bytes, dict)):
        raise ArgumentTypeError(f"model_parameters: got {type(model_parameters).__name__}; {allowed}")
    try:
        items = list(model_parameters)
    except TypeError:
        raise ArgumentTypeError(f"model_parameters: got {type(model_parameters).__name__} "
                                f"({_shown(model_parameters)}), which is not iterable; {allowed}") from None
    listed = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            if "params" not in item:
                raise ArgumentTypeError(f"model_parameters[{i}]: a param-group dict needs a \"params\" key "
                                        f"(got keys {sorted(map(str, item))})")
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            item = {**item, "params": [_unnamed(p) for p in params]}
        elif _is_named(item):
            item = item[1]
        elif not isinstance(item, torch.Tensor):
            raise ArgumentTypeError(f"model_parameters[{i}] is a {type(item).__name__} ({_shown(item)}); {allowed}")
        listed.append(item)
    return listed


def _is_named(item: Any) -> bool:
    """``item`` is a ``(name, tensor)`` pair, as ``named_parameters()`` yields."""
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)


def _unnamed(item: Any) -> Any:
    """The tensor of a ``(name, tensor)`` pair; anything else unchanged (the trainable check judges it)."""
    return item[1] if _is_named(item) else item


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def report_config(cfg: EngineConfig, ctx: DistContext) -> None:
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
        logger.warning("%s", zero_stage_note(cfg.zero.stage, ctx.world_size))
    for note in (overlap_note(cfg), gather_note(cfg)):
        if note:
            logger.info("%s", note)


def gather_note(cfg: EngineConfig) -> str | None:
    """What ``stage3_gather_16bit_weights_on_model_save: false`` does with stage 3 (None otherwise): not what it does
    in DeepSpeed, whose ZeRO-3 then writes no weights at ``save_16bit_model``."""
    if cfg.zero.stage != 3 or cfg.zero.gather_16bit_weights_on_model_save is not False:
        return None
    return ("zero_optimization.stage3_gather_16bit_weights_on_model_save is false, but save_16bit_model gathers and "
            "writes the whole 16-bit weights all the same (DeepSpeed's ZeRO-3 would write none): this engine "
            "consolidates its chunks and shards for any save")


def overlap_note(cfg: EngineConfig) -> str | None:
    """What ``zero_optimization.zenflow`` and ``offload_optimizer.super_offload`` do here, in one line (None when
    neither is set): permissions to overlap the optimizer step with compute, answered by ZeRO-Cache's own exact
    overlapped update; neither one's approximations is copied."""
    keys = cfg.zero.overlap_permissions
    if not keys:
        return None
    asked = f"{' and '.join(keys)}: accepted as permission to overlap the optimizer step with compute"
    copied = []
    if "zero_optimization.zenflow" in keys:
        copied.append("ZenFlow's stale top-k updates are not copied (its keys change nothing)")
    if "zero_optimization.offload_optimizer.super_offload" in keys:
        copied.append("SuperOffload's CPU-core split is not copied (cpuadam_cores_perc changes nothing)")
    if not cfg.zero_cache.enabled:
        return (f"{asked}; ZeRO-Cache is off in this config (zero_optimization.stage 3 with offload_optimizer, or "
                f"zero_cache.enabled, turns it on), so the step runs on the device after backward, with nothing to "
                f"overlap. {'; '.join(copied)}")
    if cfg.zero_cache.update_in_backward is False:
        return (f"{asked}, but zero_cache.update_in_backward is false, so the host update runs at step(); set it "
                f"to \"auto\" to overlap it exactly. {'; '.join(copied)}")
    return (f"{asked}: ZeRO-Cache runs its own exact overlapped update (zero_cache.update_in_backward: each host "
            f"chunk's Adam starts during backward, redone with the true clip factor when needed). {'; '.join(copied)}")


def zero_stage_note(stage: int, world_size: int) -> str:
    """What a ZeRO stage without ZeRO-Cache does here, in one line: it shards nothing, whatever the ranks."""
    if world_size == 1:
        return (f"zero_optimization.stage={stage} on one process: nothing to shard, so weights, gradients and Adam "
                "states are all held here in full (as plain data-parallel training); to put states in host memory "
                "or on NVMe, use stage 3 with offload_optimizer/offload_param or a zero_cache section")
    return (f"zero_optimization.stage={stage}: states are not sharded over the {world_size} ranks here; each holds a "
            "full replica (data parallel). Stage 3 with an offload section, or zero_cache, shards and offloads them")


def report_precision(cfg: EngineConfig) -> None:
    """One log line: the compute dtype and why; a warning, with the measured slowdown, for bf16 on a CPU
    without bf16 units."""
    precision = cfg.precision
    if precision.slow_bf16:
        logger.warning("%s", slow_bf16_warning(precision.reason))
    elif precision.reason:
        logger.info("compute dtype %s: %s", str(precision.dtype).removeprefix("torch."), precision.reason)


def place_module(model: nn.Module, device: torch.device, dtype: torch.dtype, *, keep_trainable: bool,
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


def build_optimizer(model: nn.Module, client: Any, model_parameters: Iterable | None, cfg: EngineConfig,
                    ctx: DistContext, experts: ExpertParallel | None = None) -> EngineOptimizer | None:
    """The engine's optimizer: the client's (an optimizer, or a callable given the parameters) or the config's,
    wrapped in fp32 masters (:class:`MixedPrecisionOptimizer`) or, with ``zero_cache`` on, ZeRO-Cache's hybrid Adam.

    Returns:
        The wrapped optimizer, or None when neither the client nor the config names one.

    Raises:
        ConfigError: ZeRO-Cache with expert parallelism, with an optimizer other than Adam/AdamW, or a model
            that does not fit.
    """
    params = list(model_parameters) if model_parameters is not None else [p for p in model.parameters()
                                                                          if p.requires_grad]
    if isinstance(client, torch.optim.Optimizer):
        inner = client
    elif callable(client):
        inner = client(params)
    elif cfg.optimizer is not None:
        inner = _config_optimizer(params, cfg, ctx)
    else:
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    _check_bf16_master_optimizer(client, cfg)
    scaler = LossScaler(cfg.precision.loss_scale) if cfg.precision.loss_scale is not None else None
    if cfg.zero_cache.enabled:
        if experts is not None:
            raise ConfigError("zero_cache with expert parallelism (moe.ep_size > 1) is not implemented yet; "
                              "set moe.ep_size to 1 or disable zero_cache")
        return _attach_zero_cache(model, inner, names, cfg, ctx, scaler)
    return MixedPrecisionOptimizer(inner, names, cfg.precision.dtype, loss_scaler=scaler,
                                   gradient_clipping=cfg.gradient_clipping, group=ctx.group,
                                   reduce_bucket_numel=cfg.zero.reduce_bucket_size, experts=experts,
                                   master_dtype=cfg.precision.master_dtype, comm_dtypes=_comm_dtypes(model, cfg))


def _check_bf16_master_optimizer(client: Any, cfg: EngineConfig) -> None:
    """bf16 masters with fp32 moments are DeepSpeedCPUAdam's mode (DeepSpeed asserts its type): the config's optimizer
    runs it here; a client optimizer would keep its moments in the masters' bf16.

    Raises:
        ConfigError: a client optimizer, ``torch_adam`` or ``amsgrad`` with bf16_master_weights_and_grads but not
            bf16_optimizer_states.
    """
    precision = cfg.precision
    if precision.master_dtype == torch.float32 or precision.optimizer_state_dtype != torch.float32:
        return
    if client is None:
        asked = [key for key in ("torch_adam", "amsgrad") if cfg.optimizer and getattr(cfg.optimizer, key)]
        if asked:
            raise ConfigError(f"optimizer.params.{asked[0]}: true with bf16.bf16_master_weights_and_grads (without "
                              "bf16_optimizer_states) is not supported: that mode is DeepSpeedCPUAdam's (bf16 masters, "
                              f"fp32 moments), as DeepSpeed asserts; remove {asked[0]} or set bf16_optimizer_states")
        return
    raise ConfigError("bf16.bf16_master_weights_and_grads: true without bf16_optimizer_states steps bf16 masters with "
                      "fp32 Adam moments, which only the config's optimizer does here (DeepSpeed requires its "
                      "DeepSpeedCPUAdam): pass no optimizer to initialize() and give the config an \"optimizer\" "
                      "section, or set bf16.bf16_optimizer_states true")


def _comm_dtypes(model: nn.Module, cfg: EngineConfig) -> dict[int, torch.dtype]:
    """``torch_autocast`` under ZeRO (stage >= 1): the parameters of the lower-precision-safe modules (exact class, as
    DeepSpeed matches them) have their gradients all-reduced in the autocast dtype, as DeepSpeed's ``comm_dtype``."""
    precision = cfg.precision
    if precision.autocast_dtype is None or cfg.zero.stage == 0:
        return {}
    classes = tuple(precision_modes.module_class(name) for name in precision.autocast_safe_modules)
    return {id(p): precision.autocast_dtype for module in model.modules() if type(module) in classes
            for p in module.parameters(recurse=False)}


def _config_optimizer(params: list, cfg: EngineConfig, ctx: DistContext) -> torch.optim.Optimizer:
    """The config's Adam/AdamW. On a CPU without ``torch_adam``, DeepSpeed's own C++ Adam steps it, as DeepSpeed's
    FusedAdam does there (see :mod:`angelptm.engine.deepspeed_cpu_adam`); ZeRO-Cache, which only reads the
    hyperparameters and runs its own Adam, and AMSGrad, which FusedAdam lacks, get torch's."""
    opt = cfg.optimizer
    # bf16 masters with fp32 moments (DeepSpeedCPUAdam's mode): those moments on any device, the C++ update on a CPU.
    state_dtype = cfg.precision.optimizer_state_dtype if cfg.precision.master_dtype != torch.float32 else None
    fp32_moments = state_dtype == torch.float32
    if (ctx.device.type == "cpu" or fp32_moments) and not (opt.torch_adam or opt.amsgrad or cfg.zero_cache.enabled):
        kernel = deepspeed_cpu_adam.load_kernel(opt.decoupled_weight_decay, opt.betas) if ctx.device.type == "cpu" \
            else None
        if kernel is not None or fp32_moments:
            return deepspeed_cpu_adam.DeepSpeedCpuAdam(params, kernel, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                                       weight_decay=opt.weight_decay,
                                                       decoupled_weight_decay=opt.decoupled_weight_decay,
                                                       state_dtype=state_dtype)
    cls = torch.optim.AdamW if opt.decoupled_weight_decay else torch.optim.Adam
    # On CUDA the fused kernel is torch's fastest Adam; on CPU the default foreach path.
    fused = True if ctx.device.type == "cuda" else None
    return cls(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, amsgrad=opt.amsgrad,
               fused=fused)


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
                                 sharding=_sharding(cfg, ctx), deepspeed_import=deepspeed_alias.suspended)
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


def resolve_scheduler(client: Any, optimizer: EngineOptimizer | None, cfg: EngineConfig) -> Any:
    """The LR scheduler: the client's (an object, or a callable given the inner torch optimizer), else the
    config's ``scheduler`` over ``optimizer``, else None.

    Raises:
        ConfigError: the config has a scheduler but there is no optimizer.
    """
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
