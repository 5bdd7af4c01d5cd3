"""Pipeline-parallel pretraining with AutoPipe: the GPT split where the partition search says.

``pretrain.py`` hands over here when ``"autopipe": {"enabled": true}``. Every rank builds the whole model
from the same seed, traces it at the micro-batch size, and takes rank 0's op profile (measured here, or
read from ``autopipe.profile_path``); every rank then runs the same search, so all agree on the split (those
steps and the gradients' reduction are :mod:`angelptm.pipe.autopipe_steps`, shared with ``deepspeed.pipe``).
Each rank keeps only its chunks' parameters, with fp32 masters and Adam states in a
:class:`MixedPrecisionOptimizer`.

One optimizer step = ``gradient_accumulation_steps`` micro-batches per replica, run as
``gradient_accumulation_steps / autopipe.num_microbatches`` pipeline flushes. Before the update:
data-parallel mean over the replicas of each stage, sum of tied gradients over the stages that hold them,
and clipping by the norm over the whole pipeline (each parameter counted once).

Checkpoints are written beside training in one process (``train.background_save``), through the engine's writer and
with its guarantees (:mod:`angelptm.checkpoints.background`): every tensor of the rank's states is copied to host
memory before the save returns, so the next step cannot change what lands; a save still being written is waited for
before the next save, at a stop and before an unhealthy stop moves ``latest``; a failed one raises before the next
step. With several ranks each checkpoint is written before training goes on: the end of a save is a collective,
which the writer thread must not issue beside the training thread's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from angelptm.checkpoints import architecture
from angelptm.checkpoints import background as background_save
from angelptm.checkpoints import files as checkpoint
from angelptm.config import EngineConfig, load_config, read_config_source
from angelptm.engine.mixed_precision import MixedPrecisionOptimizer
from angelptm.engine.schedulers import build_scheduler
from angelptm.errors import CheckpointError, ConfigError
from angelptm.launch.distributed import DistContext
from angelptm.pipe.autopipe_steps import plan, reduce_and_clip, shared_profile
from angelptm.pretraining import health
from angelptm.pretraining.data import TokenDataset, repeat_batches
from angelptm.pretraining.data.loader import ResumableDataLoader
from angelptm.pretraining.job_errors import RunUnhealthyError
from angelptm.pretraining.models import build_model
from angelptm.telemetry.monitor import ThroughputMeter, format_memory, memory_snapshot
from angelptm.telemetry.progress import progress_bar
from autopipe.graph import trace
from autopipe.runtime import PipelineLayout, PipelineRunner, check_microbatches

logger = logging.getLogger(__name__)
TARGET = "labels"


def check_config(cfg: EngineConfig, ctx: DistContext) -> PipelineLayout:
    """Reject what the pipeline path does not do, before any work.

    Returns:
        The rank layout.

    Raises:
        ConfigError: fp16 (no loss scaling here), ZeRO-Cache, a ranks/stages or micro-batch mismatch
            (including a micro-batch count the schedule cannot run).
    """
    ap = cfg.autopipe
    if cfg.precision.loss_scale is not None:
        raise ConfigError("autopipe.enabled with fp16: the pipeline path has no loss scaling; use bf16")
    if cfg.zero_cache.enabled:
        raise ConfigError("autopipe.enabled with zero_cache.enabled: pick one; ZeRO-Cache does not run in a pipeline")
    if cfg.moe.enabled:
        raise ConfigError("autopipe.enabled with moe.enabled: MoE blocks are not traced into pipeline stages yet")
    if cfg.optimizer is None:
        raise ConfigError("autopipe.enabled needs an \"optimizer\" section")
    if cfg.batch.gradient_accumulation_steps % ap.num_microbatches:
        raise ConfigError(f"gradient_accumulation_steps={cfg.batch.gradient_accumulation_steps}: with autopipe it "
                          f"must be a multiple of autopipe.num_microbatches={ap.num_microbatches} (one step = "
                          "whole pipeline flushes)")
    try:
        check_microbatches(ap.schedule, ap.num_microbatches, ap.num_stages)
        return PipelineLayout(world_size=ctx.world_size, num_stages=ap.num_stages,
                              virtual_stages_per_rank=ap.virtual_stages_per_rank)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def saved_split(cfg: EngineConfig, ctx: DistContext, layout: PipelineLayout) -> list[int] | None:
    """The split of the checkpoint this run resumes from (a re-profile could move the cuts), if any.

    Raises:
        CheckpointError: not an AutoPipe checkpoint, or saved by another number of ranks or chunks (checked
            here, before any profiling; :func:`resume` could not load it either).
    """
    if not cfg.train.resume:
        return None
    path = health.resume_point(cfg.train.save_dir, ctx)
    if path is None:
        return None
    meta = checkpoint.load_file(path / checkpoint.MODEL_FILE)
    if not isinstance(meta, dict) or meta.get("format") != "autopipe":
        raise CheckpointError(f"{path} is not an AutoPipe checkpoint; resume it without autopipe, or pass --save-dir "
                              "with another directory")
    changed = architecture.differences(meta.get("architecture"), architecture.gpt_record(cfg.model))
    if changed:
        raise CheckpointError(f"{path} was saved from another model architecture: {'; '.join(changed)}. Set the model "
                              "back to the recorded values, or start a new run in another directory (--save-dir "
                              "NEW_DIR)")
    op_starts = list(meta["op_starts"])
    if meta.get("world_size") != ctx.world_size or len(op_starts) != layout.num_chunks:
        raise CheckpointError(f"{path} was saved by {meta.get('world_size')} ranks in {len(op_starts)} pipeline "
                              f"chunks; this run has {ctx.world_size} ranks in {layout.num_chunks} chunks "
                              "(autopipe.num_stages x virtual_stages_per_rank). Resume with the same layout, or "
                              "pass --save-dir with another directory")
    return op_starts


def build_runner(cfg: EngineConfig, ctx: DistContext, layout: PipelineLayout, dataset: TokenDataset
                 ) -> tuple[PipelineRunner, float]:
    """Trace, profile, plan and build this rank's stages; returns the runner and FLOPs per token."""
    # Stage-level recompute replaces the blocks' own checkpointing, which would not survive the trace.
    model_cfg = dataclasses.replace(cfg.model, activation_checkpointing=False)
    torch.manual_seed(cfg.seed if cfg.seed is not None else 0)  # the same weights on every rank
    with torch.device(ctx.device):
        model = build_model(model_cfg).to(cfg.precision.dtype)
    flops_per_token = model.flops_per_token(dataset.seq_len)
    samples = [dataset[i] for i in range(cfg.batch.micro_batch_size)]
    example = {key: torch.stack([s[key] for s in samples]).to(ctx.device) for key in ("input_ids", TARGET)}
    graph = trace(model, example, TARGET)
    op_starts = saved_split(cfg, ctx, layout)
    if op_starts is None:
        profile = shared_profile(cfg, graph, example, ctx)
        report, op_starts = plan(cfg, profile, ctx.device)
        if ctx.is_main:
            logger.info("AutoPipe plan (%s, %d stages x %d chunks, %d micro-batches):\n%s", cfg.autopipe.schedule,
                        layout.num_stages, layout.virtual_stages_per_rank, cfg.autopipe.num_microbatches,
                        report.format())
    elif ctx.is_main:
        logger.info("AutoPipe: keeping the checkpoint's split, chunks start at ops %s", op_starts)
    join_group_of_one(ctx)
    runner = PipelineRunner(graph, op_starts, layout, ctx.rank, ctx.device, schedule=cfg.autopipe.schedule,
                            num_microbatches=cfg.autopipe.num_microbatches,
                            loss_scale=1.0 / cfg.batch.gradient_accumulation_steps,
                            recompute=cfg.autopipe.recompute or cfg.model.activation_checkpointing)
    return runner, flops_per_token


def join_group_of_one(ctx: DistContext) -> None:
    """torch's pipelining stages ask the default process group for their rank even when there is one stage, so a run
    of one process (no launcher, ``autopipe.num_stages`` 1) gets a group of one over an in-process store (no sockets;
    ``pretrain.py`` destroys it at the end). ``ctx`` stays a single process's: its saves publish without a collective
    and so may go on beside training."""
    if ctx.group is None and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def build_optimizer(cfg: EngineConfig, runner: PipelineRunner) -> MixedPrecisionOptimizer:
    """AdamW over this rank's parameters (decay on matrices only), with fp32 masters and gradients."""
    opt = cfg.optimizer
    named = runner.named_parameters()
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    cls = torch.optim.AdamW if opt.decoupled_weight_decay else torch.optim.Adam
    inner = cls([{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=opt.lr, betas=opt.betas, eps=opt.eps, amsgrad=opt.amsgrad,
                fused=True if decay and decay[0].device.type == "cuda" else None)
    # Reduction and clipping happen in reduce_and_clip over the pipeline's groups, not inside step().
    return MixedPrecisionOptimizer(inner, {id(p): name for name, p in named}, cfg.precision.dtype)


def train_step(cfg: EngineConfig, runner: PipelineRunner, optimizer: MixedPrecisionOptimizer, batches
               ) -> tuple[torch.Tensor | None, float]:
    """One optimizer step: ``gradient_accumulation_steps / num_microbatches`` flushes, then the update.

    The update is skipped (gradients cleared) on every rank when the global norm is not finite: the norm is
    the same on all ranks of a pipeline, and the data-parallel mean makes it the same across replicas.

    Args:
        cfg: the whole config.
        runner: this rank's stages.
        optimizer: their fp32 masters and gradient buffer.
        batches: an iterator of flush-sized batches of this replica.

    Returns:
        The summed scaled loss of the flushes (the replica's mean loss) on the last stage, None elsewhere;
        and the global gradient norm before clipping.
    """
    loss_sum = None
    for _ in range(cfg.batch.gradient_accumulation_steps // cfg.autopipe.num_microbatches):
        batch = next(batches)
        with optimizer.accumulating():
            loss = runner.step({"input_ids": batch["input_ids"]}, batch[TARGET])
        if loss is not None:
            loss_sum = loss if loss_sum is None else loss_sum + loss
    norm = reduce_and_clip(runner, optimizer, cfg.gradient_clipping)
    if math.isfinite(norm):
        optimizer.step()
    else:
        optimizer.zero_grad()
    return loss_sum, norm


def save(cfg: EngineConfig, ctx: DistContext, step: int, runner: PipelineRunner, optimizer, scheduler,
         loader: ResumableDataLoader, *, healthy: bool = True, latest: bool = True,
         background: bool = False) -> background_save.PendingSave | None:
    """Each rank writes its chunks' weights and optimizer state; rank 0 writes the layout (and whether the run was
    healthy, which pruning reads: :mod:`angelptm.pretraining.health`). ``latest``: move ``latest`` onto it.

    ``background`` (one process): return once every tensor is copied to host memory, and write and publish the
    checkpoint in the writer thread (returned; :class:`~angelptm.checkpoints.background.InFlightSave` holds it);
    otherwise it is written before this returns (None)."""
    meta = {"format": "autopipe", "world_size": ctx.world_size, "op_starts": runner.op_starts, "step": step,
            "architecture": architecture.gpt_record(cfg.model), "client_state": {health.HEALTHY_KEY: healthy}}
    beside = background and ctx.group is None
    # (in the background the writer's pickler takes each tensor to host memory itself, once; torch.save keeps a
    # tensor's device, so the synchronous save is given host copies)
    weights = {name: p.detach() if beside else p.detach().cpu() for name, p in runner.named_parameters()}
    per_rank = {"meta": meta, "module": weights,
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None,
                "loader": loader.state_dict(), "rng": checkpoint.capture_rng_state()}
    tag, shared = f"global_step{step}", {checkpoint.MODEL_FILE: meta}
    if beside:
        return background_save.save_streamed(cfg.train.save_dir, tag, ctx, shared=shared, per_rank=per_rank,
                                             snapshot=None, save_latest=latest, background=True)
    checkpoint.save(cfg.train.save_dir, tag, ctx, shared=shared, per_rank=per_rank, save_latest=latest)
    return None


def resume(cfg: EngineConfig, ctx: DistContext, runner: PipelineRunner, optimizer, scheduler,
           loader: ResumableDataLoader, *, allow_unsafe_pickle: bool = False) -> int:
    """Load this rank's part of the latest checkpoint; returns its step (0 without one).

    ``allow_unsafe_pickle``: a rank file of the previous format (numpy RNG state) loads by full unpickling."""
    path = health.resume_point(cfg.train.save_dir, ctx)  # none: no checkpoint
    if path is None:
        return 0
    state = checkpoint.load_file(path / checkpoint.rank_file(ctx.rank), allow_unsafe_pickle=allow_unsafe_pickle)
    meta = state.get("meta", {})
    if meta.get("world_size") != ctx.world_size or meta.get("op_starts") != runner.op_starts:
        raise CheckpointError(f"{path} was saved by a pipeline of {meta.get('world_size')} ranks split at ops "
                              f"{meta.get('op_starts')}; this run has {ctx.world_size} ranks split at "
                              f"{runner.op_starts}. Resume with the same layout and profile_path")
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])
    checkpoint.restore_rng_state(state["rng"])
    if ctx.is_main:
        logger.info("resumed from %s at step %d", path, meta["step"])
    return int(meta["step"])


def train(cfg: EngineConfig, ctx: DistContext, dataset: TokenDataset, *, stop_requested: Callable[[], bool],
          after_save: Callable[[], None], allow_unsafe_pickle: bool = False,
          background: bool = False) -> health.RunEnd | None:
    """Train the configured GPT as an AutoPipe pipeline.

    Args:
        cfg: the whole config (``cfg.autopipe.enabled``; the batch resolved for world / num_stages replicas).
        ctx: this rank; every rank of the job calls this.
        dataset: the token dataset.
        stop_requested: polled between steps (Ctrl-C / SIGTERM); all ranks stop together.
        after_save: called on rank 0 after each checkpoint (e.g. pruning old ones).
        allow_unsafe_pickle: resume from a checkpoint of the previous format (see :func:`resume`).
        background: write the periodic checkpoints beside training (one process; :func:`save`).

    Returns:
        How the run ended (:class:`~angelptm.pretraining.health.RunEnd`); None when the checkpoint resumed from had
        already reached ``train.steps``.
    """
    layout = check_config(cfg, ctx)
    runner, flops_per_token = build_runner(cfg, ctx, layout, dataset)
    optimizer = build_optimizer(cfg, runner)
    scheduler = build_scheduler(cfg.scheduler, optimizer) if cfg.scheduler else None
    replica = ctx.rank // layout.num_stages
    flush_size = cfg.batch.micro_batch_size * cfg.autopipe.num_microbatches
    loader = ResumableDataLoader(dataset, flush_size, rank=replica, world_size=layout.num_replicas,
                                 shuffle=cfg.data.shuffle, seed=cfg.seed or 0, num_workers=cfg.data.num_workers,
                                 reshuffle_each_epoch=cfg.data.reshuffle_each_epoch,
                                 batch_key="train_micro_batch_size_per_gpu x autopipe.num_microbatches")
    step = resume(cfg, ctx, runner, optimizer, scheduler, loader,
                  allow_unsafe_pickle=allow_unsafe_pickle) if cfg.train.resume else 0
    return run_loop(cfg, ctx, runner, optimizer, scheduler, loader, step, flops_per_token, dataset.seq_len,
                    stop_requested, after_save, background=background)


def profile_target(config_path: str | None, device: torch.device) -> tuple[torch.nn.Module, dict, str]:
    """Factory for ``python -m autopipe profile --factory angelptm.pretraining.pipeline_parallel:profile_target
    --factory-arg CONFIG``.

    Args:
        config_path: a JSON config (its "model", precision, micro-batch and sequence length are used).
        device: where to build the model.

    Returns:
        ``(model, inputs, "labels")``: the GPT in the compute dtype, one micro-batch of random token ids.
    """
    if config_path is None:
        raise ValueError("--factory-arg: pass the JSON config whose model to profile")
    raw = read_config_source(config_path)
    section = raw.get("autopipe") if isinstance(raw.get("autopipe"), dict) else {}
    stages = section.get("num_stages", 2) if section.get("enabled") else 1  # a world the batch resolves for
    cfg = load_config(raw, world_size=stages if isinstance(stages, int) and stages > 0 else 1)
    with torch.device(device):
        model = build_model(dataclasses.replace(cfg.model, activation_checkpointing=False)).to(cfg.precision.dtype)
    shape = (cfg.batch.micro_batch_size, cfg.data.seq_len or cfg.model.max_seq_len)
    ids = torch.randint(0, cfg.model.vocab_size, (shape[0], shape[1] + 1), device=device)
    return model, {"input_ids": ids[:, :-1], TARGET: ids[:, 1:].contiguous()}, TARGET


def run_loop(cfg: EngineConfig, ctx: DistContext, runner: PipelineRunner, optimizer, scheduler, loader, step: int,
             flops_per_token: float, seq_len: int, stop_requested, after_save, *,
             background: bool = False) -> health.RunEnd | None:
    """Train from ``step`` to ``train.steps``, saving every ``train.save_interval`` steps (``background``: beside
    training, :func:`save`) and at the end; returns how the run ended (None: it had already ended)."""
    if step >= cfg.train.steps:  # a finished run, started again: nothing to train, nothing to save
        return None
    batches = repeat_batches(loader)
    meter = ThroughputMeter(flops_per_token, ctx.device)
    progress = progress_bar(cfg.train.steps, step, shown=ctx.is_main)  # off a terminal: step lines only
    loss_sum, count, last_loss = torch.zeros((), device=ctx.device), 0, float("nan")
    run_health = health.RunHealth(cfg.train.max_bad_steps)
    in_flight = background_save.InFlightSave()
    prune_due = False  # after a save, at the next step: its loss tells whether the saved weights still train
    while step < cfg.train.steps and not ctx.any_rank(stop_requested()):
        in_flight.goes_on(report=True)  # (a failed save in the background is raised here, before the step)
        loss, norm = train_step(cfg, runner, optimizer, batches)
        loss_sum = loss_sum + (loss if loss is not None else 0.0)  # only the last stage holds a loss
        if not math.isfinite(norm) and ctx.is_main:
            logger.warning("step %d: non-finite gradient norm; update skipped on every rank", step + 1)
        if scheduler is not None:
            scheduler.step()
        step, count = step + 1, count + 1
        try:
            record_health(run_health, step, loss, norm, ctx)
        except RunUnhealthyError as err:
            progress.close()  # the error line starts a line of its own
            raise _stopped(err, cfg, ctx, run_health, in_flight) from None
        if prune_due and not in_flight.writing:  # (a save in the background: once it is published)
            _prune(ctx, run_health, after_save)
            prune_due = False
        meter.add_tokens(cfg.batch.train_batch_size * seq_len)
        progress.update(1)
        if step % cfg.train.log_interval == 0 or step == cfg.train.steps:
            last_loss = _log_step(cfg, ctx, step, loss_sum, count, runner, optimizer, meter)
            loss_sum, count = torch.zeros((), device=ctx.device), 0
        if step % cfg.train.save_interval == 0 and step < cfg.train.steps:
            in_flight.wait()  # a save still being written ends first (its error raised), as the engine's does
            if prune_due:  # that write outlasted save_interval steps: prune before the next, or checkpoints pile up
                _prune(ctx, run_health, after_save)
            pending = save(cfg, ctx, step, runner, optimizer, scheduler, loader, healthy=run_health.healthy,
                           latest=not run_health.diverged, background=background)
            if pending is not None:
                in_flight.hold(pending)
            prune_due = True
    progress.close()
    diverged = run_health.ended_diverged(step)
    if diverged is not None:  # however short the run: never "done" with a NaN loss, and no NaN checkpoint as latest
        raise _stopped(diverged, cfg, ctx, run_health, in_flight)
    if count:  # stopped between two step lines: the line of the last step it ran
        last_loss = _log_step(cfg, ctx, step, loss_sum, count, runner, optimizer, meter)
    in_flight.wait()  # (the last save is written before the run ends, after any still in the background)
    save(cfg, ctx, step, runner, optimizer, scheduler, loader, healthy=run_health.healthy)
    if ctx.is_main:
        after_save()
    return health.RunEnd(step=step, loss=last_loss, interrupted=step < cfg.train.steps)


def _log_step(cfg: EngineConfig, ctx: DistContext, step: int, loss_sum: torch.Tensor, count: int,
              runner: PipelineRunner, optimizer, meter: ThroughputMeter) -> float:
    """Print the step line (rank 0) of the ``count`` steps up to ``step``; returns their mean loss (a collective)."""
    if ctx.group is not None:  # only the last stage of each replica holds a loss
        dist.all_reduce(loss_sum, group=ctx.group)
    loss = loss_sum.item() / (count * runner.layout.num_replicas)
    rates = meter.lap()
    if ctx.is_main:
        tqdm.write(f"step {step}/{cfg.train.steps} | loss {loss:.4f} | lr {optimizer.param_groups[0]['lr']:.3e}"
                   f" | {rates['tokens_per_s']:,.0f} tokens/s | {rates['tflops'] / ctx.world_size:.3f} TFLOPS "
                   f"per GPU | {format_memory(memory_snapshot(ctx.device))}")
    return loss


def _prune(ctx: DistContext, run_health: health.RunHealth, after_save: Callable[[], None]) -> None:
    """Prune (``after_save``, rank 0) once the last save is published, unless the run diverged since (the last good
    checkpoint is kept)."""
    if ctx.is_main and not run_health.diverged:
        after_save()


def _stopped(err: RunUnhealthyError, cfg: EngineConfig, ctx: DistContext, run_health: health.RunHealth,
             in_flight: background_save.InFlightSave) -> RunUnhealthyError:
    """``err`` naming the checkpoint to resume from, which ``latest`` names again (rank 0; the others: ``err``), once
    a save still being written has ended (:func:`~angelptm.checkpoints.background.settle_before_stop`)."""
    background_save.settle_before_stop(in_flight.wait)
    if not ctx.is_main:
        return err
    return health.stop_unhealthy(err, cfg.train.save_dir, run_health)


def record_health(run_health: health.RunHealth, step: int, loss: torch.Tensor | None, norm: float,
                  ctx: DistContext) -> None:
    """Count the step in ``run_health`` (raises after ``train.max_bad_steps`` bad steps in a row).

    The norm is the same on every rank, so all ranks agree whether the step was applied; only for a skipped step
    do they ask (one collective) whether a last stage's loss was non-finite, which names the cause.
    """
    applied = math.isfinite(norm)
    finite = applied or not ctx.any_rank(loss is not None and not bool(torch.isfinite(loss).all()))
    run_health.record(step, applied=applied, finite=finite)
