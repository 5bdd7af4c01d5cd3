"""The typed config tree the engine consumes, built once from the JSON edge.

One ``@dataclass(kw_only=True, slots=True)`` per component, checks in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from angelptm.pretraining.data.config import DataConfig
from angelptm.pretraining.models import ModelConfig
from autopipe import AutoPipeConfig
from moe import MoEConfig
from zero_cache import ZeroCacheConfig


@dataclass(kw_only=True, slots=True)
class BatchConfig:
    """train_batch_size = micro_batch_size * gradient_accumulation_steps * world_size, always."""

    train_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro-batches accumulated before each optimizer step."""
    world_size: int
    """Data-parallel ranks."""

    def __post_init__(self) -> None:
        product = self.micro_batch_size * self.gradient_accumulation_steps * self.world_size
        assert product == self.train_batch_size, "resolve_batch_sizes guarantees the product"


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Adam with decoupled (AdamW) or L2 (Adam) weight decay."""

    lr: float = 1e-3
    """Peak learning rate (a scheduler may scale it)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decay rates."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 0.0
    """Weight decay coefficient."""
    decoupled_weight_decay: bool = True
    """True = AdamW (Loshchilov & Hutter); False = Adam with L2 in the gradient."""
    amsgrad: bool = False
    """Use the AMSGrad variant."""
    torch_adam: bool = False
    """Step with torch's Adam/AdamW (DeepSpeed's ``torch_adam``). False steps as DeepSpeed's FusedAdam does: on a CPU
    with DeepSpeed's own C++ Adam (bit-equal weights; ZeRO-Cache runs its own), on a GPU with torch's fused Adam."""

    def __post_init__(self) -> None:
        check_optimizer_values(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


MAX_LR = 10.0
"""Largest ``optimizer.params.lr`` (and ``weight_decay``) accepted. Adam's step moves each weight by about lr,
so an lr above this wrecks the weights at the first step and every later step is skipped (issue 38: lr 1e10
ended "done: final loss nan" with exit 0); typical AdamW rates are 1e-5 to 1e-2."""


MIN_EPS = torch.finfo(torch.float32).tiny
"""Smallest ``optimizer.params.eps`` accepted: float32's smallest normal (1.18e-38). Adam's masters and moments are
fp32 in every engine path (``PrecisionConfig``), so a smaller eps (1e-300) rounds to 0 there and
``m / (sqrt(v) + eps)`` is 0 / 0 for a parameter whose gradient was 0."""


def check_optimizer_values(*, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Refuse absurd Adam hyperparameters (NaN fails every comparison below, so it is refused too).

    Raises:
        ValueError: one line naming the key, the value and the range allowed.
    """
    if not 0.0 <= lr <= MAX_LR:
        raise ValueError(f"optimizer.params.lr: {lr!r} is outside [0, {MAX_LR:g}]; lower it "
                         "(typical AdamW rates are 1e-5 to 1e-2)")
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"optimizer.params.betas: {tuple(betas)!r} has a value outside [0, 1); use e.g. [0.9, 0.999]")
    if not MIN_EPS <= eps < 1.0:
        raise ValueError(f"optimizer.params.eps: {eps!r} is outside [{MIN_EPS:.3g}, 1): below float32's smallest "
                         "normal the fp32 Adam states hold it as 0 or a denormal, which no longer guards the division; "
                         "use e.g. 1e-8")
    if not 0.0 <= weight_decay <= MAX_LR:
        raise ValueError(f"optimizer.params.weight_decay: {weight_decay!r} is outside [0, {MAX_LR:g}]; "
                         "use e.g. 0.01 or 0.1")


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """One of DeepSpeed's schedulers, with DeepSpeed's parameter names."""

    type: str
    """"WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"."""
    params: dict[str, Any] = field(default_factory=dict)
    """The scheduler's keyword arguments, already validated against its parameter model."""


@dataclass(kw_only=True, slots=True)
class LossScaleConfig:
    """fp16 loss scaling, with DeepSpeed's DynamicLossScaler semantics."""

    static_scale: float | None = None
    """A fixed scale; None selects dynamic scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    window: int = 1000
    """Overflow-free steps before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is lowered."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every overflow-free step, not only when the scale grows."""
    min_scale: float = 1.0
    """The scale never goes below this."""

    def __post_init__(self) -> None:
        if self.static_scale is not None and self.static_scale <= 0:
            raise ValueError(f"fp16.loss_scale: must be > 0 (or 0 for dynamic), got {self.static_scale}")
        if self.window < 1:
            raise ValueError(f"fp16.loss_scale_window: must be >= 1, got {self.window}")
        if self.hysteresis < 1:
            raise ValueError(f"fp16.hysteresis: must be >= 1, got {self.hysteresis}")
        if self.min_scale <= 0:
            raise ValueError(f"fp16.min_loss_scale: must be > 0, got {self.min_scale}")


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    """Compute dtype of the module, the dtypes of master weights and Adam moments, and torch.autocast's dtype."""

    dtype: torch.dtype = torch.float32
    """torch.float32, torch.bfloat16 or torch.float16: the dtype of the module's parameters."""
    master_dtype: torch.dtype = torch.float32
    """Master weights and gradient accumulation: fp32, or bf16 under ``bf16.bf16_master_weights_and_grads``."""
    optimizer_state_dtype: torch.dtype = torch.float32
    """Adam's exp_avg and exp_avg_sq: fp32, or bf16 under ``bf16.bf16_optimizer_states``."""
    autocast_dtype: torch.dtype | None = None
    """``torch_autocast``: the forward runs under ``torch.autocast`` in this dtype over fp32 parameters; None: off."""
    autocast_safe_modules: tuple[str, ...] = ()
    """``torch_autocast.lower_precision_safe_modules`` (qualified class names): with ZeRO (stage >= 1) and more than
    one rank, their parameters' gradients are all-reduced in ``autocast_dtype``, as DeepSpeed's ZeRO does."""
    loss_scale: LossScaleConfig | None = None
    """Set only for fp16 (and fp16 ``torch_autocast`` without ZeRO, as DeepSpeed's GradScaler there)."""
    cast_inputs: bool = False
    """Cast floating-point forward inputs to the compute dtype (DeepSpeed's fp16.auto_cast)."""
    reason: str = ""
    """Why this dtype on this device, for the log (``angelptm.config.precision`` has the rule)."""
    slow_bf16: bool = False
    """bf16 was asked for on a CPU without bf16 units: kept, and warned about with the measured slowdown."""


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """Logging of training metrics."""

    steps_per_print: int = 10
    """Engine log line every this many optimizer steps."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately (synchronises the device when on)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard events here (None = off)."""
    csv_dir: str | None = None
    """Write a CSV of metrics here (None = off)."""
    log_level: str | None = None
    """DeepSpeed's ``log_level`` ("debug" ... "critical"): the ``angelptm`` logger's level, set at ``initialize()``
    (None = INFO in a script that configured no logging, else the application's choice)."""

    def __post_init__(self) -> None:
        if self.steps_per_print < 1:
            raise ValueError(f"steps_per_print: must be >= 1, got {self.steps_per_print}")


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """DeepSpeed's ``zero_optimization`` keys that the engine or ZeRO-Cache act on."""

    stage: int = 0
    """ZeRO stage as written in the config."""
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient all-reduce bucket."""
    offload_param_device: str = "none"
    """"none", "cpu" or "nvme": where ``zero.Init`` builds the model (off the device when params may live there).
    ``offload_optimizer`` has no field: it only turns ZeRO-Cache on (with stage 3), which the loader decides."""
    overlap_permissions: tuple[str, ...] = ()
    """DeepSpeed 0.19.8's keys present that ask for the optimizer step to overlap compute (``zenflow``,
    ``offload_optimizer.super_offload``): permissions, which ZeRO-Cache's own exact overlapped update answers."""
    gather_16bit_weights_on_model_save: bool | None = None
    """``stage3_gather_16bit_weights_on_model_save`` as written (None: absent). ``save_16bit_model`` gathers and writes
    the whole 16-bit weights at either value, as DeepSpeed's ZeRO-3 does with true; with stage 3, false (where
    DeepSpeed would write no weights) is named at start-up."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The training loop of ``pretrain.py`` (the ``"train"`` section)."""

    steps: int = 300
    """Optimizer steps to train for (resuming counts the steps already done)."""
    save_dir: str = "checkpoints/run"
    """Checkpoints go here; an existing ``latest`` is resumed from."""
    save_interval: int = 100
    """Save every this many optimizer steps (and at the end, and on interruption)."""
    log_interval: int = 10
    """Print a metrics line every this many optimizer steps."""
    keep_last: int = 3
    """Keep the newest this many step checkpoints in save_dir; older ones are deleted after each save."""
    resume: bool = True
    """Continue from ``save_dir``'s latest checkpoint when there is one."""
    background_save: bool = True
    """Write each checkpoint beside training: ``save_checkpoint`` returns once the first chunks of ZeRO-Cache's states
    are staged, and ``latest`` moves when every file is complete and fsynced (docs/checkpoints.md). The run waits for
    a save in progress before the next one, before it stops (finished, interrupted or unhealthy) and at exit. AutoPipe
    in one process copies its stage's states to host memory at the save and writes them beside training. Where it is
    not supported (several ranks, or the engine without ZeRO-Cache) the save is written before training goes on, as
    with false (``--no-background-save``)."""
    max_bad_steps: int = 20
    """Stop the run (non-zero exit, naming the last healthy checkpoint) after this many consecutive steps without a
    healthy one (applied, not skipped for overflow, finite loss): a diverged or corrupted run must not go on
    saving wrecked checkpoints."""

    def __post_init__(self) -> None:
        for name in ("steps", "save_interval", "log_interval", "keep_last", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class CommsConfig:
    """How the ranks of a job wait for each other, and notice one is gone (the ``"comms"`` section)."""

    timeout_s: float = 600.0
    """Collective timeout of the process group, in seconds (DeepSpeed's default, 10 minutes; DeepSpeed sets
    it only through ``DEEPSPEED_TIMEOUT``). It must cover the longest wait of one rank for another, e.g.
    rank 0 writing a large checkpoint or tokenizing the data."""
    lost_rank_after_s: float = 30.0
    """A rank whose heartbeat stands still this long (its process died or stopped) is lost, and every rank
    stops with an error naming it (``angelptm.launch.liveness``); 0 turns the heartbeat off. A rank stuck while its
    process lives still beats: ``timeout_s`` ends that job."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"comms.timeout_s: must be > 0 seconds, got {self.timeout_s}")
        if self.lost_rank_after_s < 0:
            raise ValueError(f"comms.lost_rank_after_s: must be >= 0 seconds (0 = off), got {self.lost_rank_after_s}")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Everything one training run is configured with."""

    batch: BatchConfig
    precision: PrecisionConfig
    optimizer: OptimizerConfig | None
    """None when the JSON has no "optimizer" (the script passes its own, or none)."""
    scheduler: SchedulerConfig | None
    gradient_clipping: float
    """Clip the global gradient norm to this (0 = off)."""
    zero: ZeroConfig
    zero_cache: ZeroCacheConfig
    monitor: MonitorConfig
    seed: int | None
    """Seed for python/numpy/torch at initialize() (None: leave the caller's RNG state alone)."""
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    moe: MoEConfig
    autopipe: AutoPipeConfig
    comms: CommsConfig = field(default_factory=CommsConfig)
    """Process-group timeout and the lost-rank heartbeat."""
    accepted_not_acted: tuple[str, ...] = ()
    """Keys present in the JSON that load fine but change nothing (reported once)."""
