"""GPT pretraining from a DeepSpeed-style JSON config: the main job.

    python pretrain.py                      # the tiny default (configs/tiny.json), CPU or GPU
    python pretrain.py --config FILE        # any config
    torchrun --nproc-per-node 2 pretrain.py --config FILE   # data parallel
    torchrun --nproc-per-node 2 pretrain.py --config configs/tiny_autopipe.json   # AutoPipe pipeline

The model comes from the config's "model" section, the tokens from "data" (the shipped
public-domain corpus when no path is given), the loop from "train". A run that finds a checkpoint
in ``train.save_dir`` continues from it; Ctrl-C or SIGTERM finishes the current step, saves, and exits. With
ZeRO-Cache or AutoPipe in one process the periodic checkpoints are written beside training
(``train.background_save``); the run waits for one still being written before the next save and before it ends.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import angelptm
from angelptm.checkpoints import files as checkpoint_files
from angelptm.checkpoints.background import settle_before_stop
from angelptm.checkpoints.safe_pickle import OPT_IN_HELP
from angelptm.config import EngineConfig, load_config, read_config_source
from angelptm.engine.builders import report_precision
from angelptm.errors import CheckpointError, ConfigError, DataError
from angelptm.launch.distributed import DistContext, init_distributed, launcher_world_size
from angelptm.memory.fit_check import check_config_fits
from angelptm.memory.oom import StepOutOfMemoryError
from angelptm.memory.plan_report import DEFAULT_TFLOPS, PlanRequest, named_hardware, plan_report
from angelptm.pretraining import health
from angelptm.pretraining import pipeline_parallel as pipeline
from angelptm.pretraining.data import TokenDataset, prepare_default_dataset, repeat_batches
from angelptm.pretraining.data.tokenizer import configured_tokenizer
from angelptm.pretraining.job_errors import RunUnhealthyError, comms_timeout, one_line
from angelptm.pretraining.models import build_model
from angelptm.pretraining.save_dir import prune_checkpoints, refuse_fresh_start_over_a_run, resume
from angelptm.telemetry.monitor import ThroughputMeter, format_memory, format_tiers, memory_snapshot
from angelptm.telemetry.progress import progress_bar

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.json"
logger = logging.getLogger("pretrain")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="JSON config (default: configs/tiny.json)")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--save-dir", help="override train.save_dir")
    parser.add_argument("--no-resume", action="store_true", help="start fresh even if save_dir has a checkpoint")
    parser.add_argument("--no-background-save", action="store_true",
                        help="write each checkpoint before training goes on (train.background_save: false)")
    parser.add_argument("--allow-unsafe-pickle", action="store_true",
                        help=OPT_IN_HELP)
    parser.add_argument("--plan", action="store_true",
                        help="print where ZeRO-Cache would place the model states (or the shortfall) and exit")
    parser.add_argument("--ranks", type=int,
                        help="with --plan: data-parallel ranks to plan for (default: --gpus, else 1)")
    parser.add_argument("--ranks-per-host", type=int,
                        help="with --plan: ranks sharing one host's RAM (default: --gpus, else all of --ranks)")
    hardware = parser.add_argument_group("--plan for named hardware, without it (else this machine is measured)")
    hardware.add_argument("--gpus", type=int, help="GPUs per host (each a rank)")
    hardware.add_argument("--device-memory", metavar="SIZE", help="memory of one GPU, e.g. 24GiB, 80GiB")
    hardware.add_argument("--host-memory", metavar="SIZE", help="RAM of one host, e.g. 256GiB, 2TiB")
    hardware.add_argument("--nvme", metavar="SIZE", help="free NVMe space of one host for the disk tier, e.g. 2TB")
    hardware.add_argument("--tflops", type=positive_number, default=DEFAULT_TFLOPS,
                          help=f"model TFLOPS one GPU sustains, for the compute floor (default {DEFAULT_TFLOPS:.0f})")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="write a Chrome/Perfetto trace and a PNG of the step after warm-up under DIR")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe messages shown: DEBUG adds the engine's internals, WARNING shows only "
                             "problems (the step lines are always printed; default: INFO)")
    return parser.parse_args(argv)


def positive_number(text: str) -> float:
    """An argument that must be a finite number above zero (argparse names the option in its message)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def plan_request(args: argparse.Namespace) -> PlanRequest:
    """The ranks and machine ``--plan`` plans for."""
    hardware = named_hardware(gpus=args.gpus, device_memory=args.device_memory, host_memory=args.host_memory,
                              nvme=args.nvme)
    ranks = args.ranks or (hardware.gpus_per_host if hardware is not None else 1)
    return PlanRequest(ranks=ranks, ranks_per_host=args.ranks_per_host, hardware=hardware, tflops=args.tflops)


def read_config(args: argparse.Namespace) -> dict:
    """The JSON config with the command-line overrides applied (still a dict: the edge parses it)."""
    path = Path(args.config)
    raw = read_config_source(path)
    train = raw.setdefault("train", {})
    if not isinstance(train, dict):
        raise ConfigError(f"{path}: \"train\" must be a JSON object {{...}}, not a {json_type(train)}")
    if args.steps is not None:
        train["steps"] = args.steps
    if args.save_dir is not None:
        train["save_dir"] = args.save_dir
    if args.no_resume:
        train["resume"] = False
    if args.no_background_save:
        train["background_save"] = False
    return raw


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for messages."""
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def build_dataset(cfg: EngineConfig, ctx: DistContext) -> TokenDataset:
    """The token dataset; the shipped corpus is tokenized by rank 0 (with ``data.tokenizer``) while the others wait."""
    tokenizer = None if cfg.data.tokenizer is None else configured_tokenizer(
        cfg.data.tokenizer, model_vocab_size=cfg.model.vocab_size)  # checked before the model is built
    prefix = cfg.data.path
    if prefix is None:
        if ctx.is_main:
            prepare_default_dataset(cfg.data.cache_dir, tokenizer)
        ctx.barrier()
        prefix = prepare_default_dataset(cfg.data.cache_dir, tokenizer)  # finds rank 0's copy valid and reuses it
    try:  # its header and every id are checked here, before a step can read a bad one
        dataset = TokenDataset(prefix, cfg.data.seq_len or cfg.model.max_seq_len)
    except DataError:
        raise
    except (OSError, ValueError) as err:  # missing, truncated or foreign files: one line, not a traceback
        raise DataError(f"data.path {str(prefix)!r}: {err}") from None
    dataset.check_vocabulary(cfg.model.vocab_size)
    if tokenizer is not None and dataset.vocab_size != tokenizer.vocab_size:
        raise DataError(f"data.path {str(prefix)!r} was written with a {dataset.vocab_size}-token tokenizer, but "
                        f"data.tokenizer {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens; give the tokenizer "
                        "the data was made with, or re-tokenize the text with this one (angelptm-preprocess)")
    return dataset


def mean_over_ranks(value: float, ctx: DistContext) -> float:
    if ctx.group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, group=ctx.group)
    return tensor.item() / ctx.world_size


class StopRequest:
    """Turns SIGINT/SIGTERM into a flag checked between steps, so the run saves before exiting."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:  # a second Ctrl-C means "now"
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("received %s: finishing this step, saving a checkpoint, then exiting",
                       signal.Signals(signum).name)


def train(raw: dict, *, allow_unsafe_pickle: bool = False, trace_dir: Path | None = None) -> health.RunEnd | None:
    """Run the configured training; returns how it ended (None: the run had already finished).

    ``allow_unsafe_pickle``: resume from a previous-format checkpoint (see ``angelptm.checkpoints.safe_pickle``).

    Raises:
        RankLostError: another rank died or hung (named), and a collective with it failed or timed out.
    """
    cfg = load_config(raw, world_size=launcher_world_size())
    ctx = init_distributed(timeout_s=cfg.comms.timeout_s, lost_rank_after_s=cfg.comms.lost_rank_after_s)
    try:
        end = _train(cfg, ctx, allow_unsafe_pickle, trace_dir)
    except RuntimeError as err:  # gloo names a socket, not a rank: ask the heartbeat who is gone
        if isinstance(err, (CheckpointError, StepOutOfMemoryError, RunUnhealthyError)):
            raise
        lost = ctx.watchdog.explain(err) if ctx.watchdog is not None else None
        if lost is None:
            lost = comms_timeout(err, ctx.rank, ctx.world_size, cfg.comms.timeout_s)
        if lost is None:
            raise
        raise lost from err
    if ctx.is_main:  # a clean end (finished or interrupted): the next run takes the lock from no one
        checkpoint_files.release_directory(cfg.train.save_dir)
    return end


def _train(cfg: EngineConfig, ctx: DistContext, allow_unsafe_pickle: bool, trace_dir: Path | None
           ) -> health.RunEnd | None:
    if not cfg.train.resume:
        refuse_fresh_start_over_a_run(cfg.train.save_dir, ctx)
    # At the start, not at the first save: a file, read-only or taken save_dir stops the job now. One that does not
    # exist yet is created after the config and data checks, so a job refused for those leaves nothing behind.
    claimed = ctx.is_main and Path(cfg.train.save_dir).exists()
    if claimed:
        checkpoint_files.claim_directory(cfg.train.save_dir)
    torch.manual_seed(cfg.seed if cfg.seed is not None else 0)  # model init is reproducible either way
    if not cfg.autopipe.enabled:  # fits or explains before a byte of the model exists (the plan of --plan)
        check_config_fits(cfg, world_size=ctx.world_size, ranks_per_host=ctx.local_world_size, device=ctx.device)
    dataset = build_dataset(cfg, ctx)
    if ctx.is_main and not claimed:
        checkpoint_files.claim_directory(cfg.train.save_dir)
    if cfg.autopipe.enabled:  # pipeline parallelism: pretraining/pipeline_parallel.py builds the stages and optimizer
        if ctx.is_main:
            report_precision(cfg)  # initialize() reports it on the other path
        stop = StopRequest()
        if trace_dir is not None:
            raise ConfigError("--trace pictures one engine's step; the AutoPipe pipeline has no tracer yet "
                              "(drop --trace, or trace the model without autopipe)")
        end = pipeline.train(cfg, ctx, dataset, stop_requested=lambda: stop.requested,
                             after_save=lambda: prune_checkpoints(cfg.train.save_dir, cfg.train.keep_last),
                             allow_unsafe_pickle=allow_unsafe_pickle, background=background_saves(cfg, ctx))
        if end is None:
            say_nothing_to_train(cfg, ctx)
        return end
    model = build_model(cfg.model, moe=cfg.moe)
    weight_decay = cfg.optimizer.weight_decay if cfg.optimizer else 0.0
    engine, _, loader, _ = angelptm.initialize(model=model, model_parameters=model.param_groups(weight_decay),
                                               training_data=dataset, config=cfg)
    save_dir = cfg.train.save_dir
    # Resumes whenever save_dir holds checkpoints, `latest` or not (none that verifies: an error naming them).
    path = resume(engine, save_dir, ctx, allow_unsafe_pickle=allow_unsafe_pickle) if cfg.train.resume else None
    if path and ctx.is_main:
        logger.info("resumed from %s at step %d", path, engine.global_steps)
    elif ctx.is_main:  # the first run of a save_dir: nothing is wrong, so no warning
        logger.info("no checkpoint in %s yet: starting fresh", save_dir)
    if ctx.is_main:
        logger.info("model: %s flavour, %.2fM parameters; %d ranks x micro-batch %d x %d accumulation = %d "
                    "sequences of %d tokens per step; device %s, dtype %s", cfg.model.flavour,
                    model.num_params() / 1e6, ctx.world_size, cfg.batch.micro_batch_size,
                    cfg.batch.gradient_accumulation_steps, cfg.batch.train_batch_size, dataset.seq_len,
                    ctx.device, cfg.precision.dtype)
    return run_loop(engine, cfg, ctx, loader, dataset.seq_len, trace_dir)


def run_loop(engine: angelptm.Engine, cfg: EngineConfig, ctx: DistContext, loader, seq_len: int,
             trace_dir: Path | None = None) -> health.RunEnd | None:
    """Train to ``cfg.train.steps``; with ``trace_dir``, trace the step after this run's first (warm-up) step.

    Returns:
        How the run ended (its last step's logged loss, and whether a stop request ended it early); None when the
        run had already reached ``train.steps`` (a finished run, again).

    Raises:
        RunUnhealthyError: no healthy step in ``train.max_bad_steps``, the fp16 loss scale overflowing at its
            minimum, or a non-finite loss at the end however short the run; ``latest`` names the last
            checkpoint to trust (:mod:`angelptm.pretraining.health`).
    """
    if engine.global_steps >= cfg.train.steps:
        say_nothing_to_train(cfg, ctx)
        return None
    batches = repeat_batches(loader)
    first_step = engine.global_steps
    meter = ThroughputMeter(engine.module.flops_per_token(seq_len), ctx.device)
    stop = StopRequest()
    tokens_per_step = cfg.batch.train_batch_size * seq_len
    progress = progress_bar(cfg.train.steps, engine.global_steps, shown=ctx.is_main)  # off a terminal: step lines only
    loss_sum, loss_count, last_loss = 0.0, 0, float("nan")
    run_health = health.RunHealth(cfg.train.max_bad_steps)
    background = background_saves(cfg, ctx)
    prune_due = False  # after a save, at the next step: its loss tells whether the saved weights still train
    while engine.global_steps < cfg.train.steps and not ctx.any_rank(stop.requested):
        if trace_dir is not None and engine.global_steps == first_step + 1:
            engine.trace_next_step(trace_dir / f"rank{ctx.rank}" if ctx.world_size > 1 else trace_dir)
        try:
            step_losses = train_step(engine, cfg, batches)
            record_health(engine, ctx, run_health, step_losses)
        except RunUnhealthyError as err:
            progress.close()  # the error line starts a line of its own
            raise stopped_unhealthy(err, engine, cfg, ctx, run_health) from None
        if prune_due and not engine.saving_in_background:  # (a save in the background: once it is published)
            prune_due = prune(cfg, ctx, run_health)
        loss_sum, loss_count = loss_sum + sum(step_losses), loss_count + len(step_losses)
        meter.add_tokens(tokens_per_step)
        progress.update(1)
        step = engine.global_steps
        if step % cfg.train.log_interval == 0 or step == cfg.train.steps:
            last_loss = mean_over_ranks(loss_sum / loss_count, ctx)
            loss_sum, loss_count = 0.0, 0
            log_metrics(step, last_loss, engine, meter, ctx, cfg.train.steps)
        if step % cfg.train.save_interval == 0 and step < cfg.train.steps:
            if prune_due:  # the last save still being written (a write longer than save_interval steps): finish
                engine.wait_for_checkpoint()  # it and prune before the next begins, or checkpoints pile up
                prune_due = prune(cfg, ctx, run_health)
            save(engine, cfg, run_health, background=background)
            prune_due = True
    progress.close()
    engine.finish_trace()
    diverged = run_health.ended_diverged(engine.global_steps)
    if diverged is not None:  # however short the run: never "done" with a NaN loss, and no NaN checkpoint as latest
        raise stopped_unhealthy(diverged, engine, cfg, ctx, run_health)
    if loss_count:  # stopped between two step lines: the line of the last step it ran
        last_loss = mean_over_ranks(loss_sum / loss_count, ctx)
        log_metrics(engine.global_steps, last_loss, engine, meter, ctx, cfg.train.steps)
    save(engine, cfg, run_health)  # (written before it returns, after any save still in the background)
    if ctx.is_main:
        prune_checkpoints(cfg.train.save_dir, cfg.train.keep_last)
    return health.RunEnd(step=engine.global_steps, loss=last_loss, interrupted=engine.global_steps < cfg.train.steps)


def train_step(engine: angelptm.Engine, cfg: EngineConfig, batches) -> list[float]:
    """One optimizer step: its micro-batches' losses.

    Raises:
        RunUnhealthyError: fp16 gradients overflowed at ``fp16.min_loss_scale`` (DeepSpeed stops there too).
    """
    losses = []
    for _ in range(cfg.batch.gradient_accumulation_steps):
        loss = engine(**next(batches))
        engine.backward(loss)
        try:
            engine.step()
        except FloatingPointError as err:  # the loss scaler's: one error line, not a traceback
            raise RunUnhealthyError(f"step {engine.global_steps + 1}: {err}") from None
        losses.append(loss.item())
    return losses


def record_health(engine: angelptm.Engine, ctx: DistContext, run_health: health.RunHealth,
                  step_losses: list[float]) -> None:
    """Count the step in ``run_health`` (raises after ``train.max_bad_steps`` bad steps in a row)."""
    # Every rank reaches the same verdict (a rank's loss alone may be non-finite), or one would stop alone.
    finite = not ctx.any_rank(not all(math.isfinite(value) for value in step_losses))
    applied = engine.was_step_applied()
    scaler = engine.optimizer.loss_scaler if engine.optimizer is not None else None
    # A skip by fp16's dynamic scaler is its search for a scale that fits, not divergence.
    run_health.record(engine.global_steps, applied=applied, finite=finite,
                      scale_search=not applied and scaler is not None and scaler.dynamic)


def stopped_unhealthy(err: RunUnhealthyError, engine: angelptm.Engine, cfg: EngineConfig, ctx: DistContext,
                      run_health: health.RunHealth) -> RunUnhealthyError:
    """``err`` naming the checkpoint to resume from, which ``latest`` names again (rank 0; the others: ``err``).

    A save still in the background is finished first (:func:`angelptm.checkpoints.background.settle_before_stop`)."""
    settle_before_stop(engine.wait_for_checkpoint)
    if not ctx.is_main:
        return err
    return health.stop_unhealthy(err, cfg.train.save_dir, run_health)


def say_nothing_to_train(cfg: EngineConfig, ctx: DistContext) -> None:
    """A finished run started again: say so and how to go on, rather than report a loss of nan."""
    if ctx.is_main:
        logger.info("nothing to train: the run in %s is already at its last step (train.steps %d). To train "
                    "further, raise train.steps (e.g. --steps %d); for a new run, pass another --save-dir",
                    cfg.train.save_dir, cfg.train.steps, 2 * cfg.train.steps)


def background_saves(cfg: EngineConfig, ctx: DistContext) -> bool:
    """Whether the periodic saves go on beside training (``train.background_save``, one process; the engine writes
    them so with ZeRO-Cache, and before returning elsewhere; AutoPipe's loop writes them so too)."""
    if cfg.train.background_save and ctx.world_size > 1 and ctx.is_main:
        logger.info("train.background_save: with %d ranks each checkpoint is written before training goes on (the "
                    "end of a save is a collective)", ctx.world_size)
    return cfg.train.background_save and ctx.world_size == 1


def prune(cfg: EngineConfig, ctx: DistContext, run_health: health.RunHealth) -> bool:
    """Keep the newest ``train.keep_last`` checkpoints once the last save is published, unless the run diverged
    since (the last good one is kept); returns False: no prune is due any more."""
    if ctx.is_main and not run_health.diverged:
        prune_checkpoints(cfg.train.save_dir, cfg.train.keep_last)
    return False


def save(engine: angelptm.Engine, cfg: EngineConfig, run_health: health.RunHealth, *,
         background: bool = False) -> None:
    """Save a checkpoint recording whether the run is healthy; ``latest`` moves onto it unless a non-finite loss
    came since the last healthy step (that checkpoint is kept for inspection, never resumed by default).

    ``background``: return once it is staged (:meth:`angelptm.Engine.save_checkpoint`); a save still being written
    is waited for first either way."""
    engine.save_checkpoint(cfg.train.save_dir, client_state={health.HEALTHY_KEY: run_health.healthy},
                           save_latest=not run_health.diverged, background=background)


def log_metrics(step: int, loss: float, engine: angelptm.Engine, meter: ThroughputMeter, ctx: DistContext,
                total_steps: int) -> None:
    rates = meter.lap()
    memory = memory_snapshot(ctx.device)
    tiers = engine.optimizer.report() if hasattr(engine.optimizer, "report") else {}  # ZeRO-Cache only
    moe = engine.module.moe_metrics() if hasattr(engine.module, "moe_metrics") else {}  # router loss, expert load
    if not ctx.is_main:
        return
    lr = engine.get_lr()[0]
    tflops = rates.get("tflops", float("nan"))
    tqdm.write(f"step {step}/{total_steps} | loss {loss:.4f} | lr {lr:.3e} | {rates['tokens_per_s']:,.0f} tokens/s "
               f"| {tflops:.3f} TFLOPS | {format_memory(memory)}{format_tiers(tiers)}"
               + "".join(f" | {name} {value:.4f}" for name, value in moe.items()))
    if engine.monitor is not None and engine.monitor.enabled:  # the engine writes loss and lr itself
        engine.monitor.write(step, {"loss_all_ranks": loss, **rates, **memory, **tiers, **moe})


def print_plan(raw: dict, request: PlanRequest = PlanRequest()) -> int:
    """``--plan``: lay the model out on the meta device and plan it for every rank, allocating nothing;
    prints a table of tiers, bytes, groups and the step's bound (``angelptm.memory.plan_report``). Returns 0 when
    it fits, 2 when it does not (the message names the tier and the shortfall)."""
    device_type = "cuda" if request.hardware is not None or torch.cuda.is_available() else "cpu"
    cfg = load_config(raw, world_size=request.ranks, device_type=device_type)
    try:
        text, fits = plan_report(cfg, request)
    except ConfigError:
        raise
    except ValueError as err:  # the layout refused the config (e.g. a chunk_size below the largest parameter)
        raise ConfigError(str(err)) from None
    print(text)
    return 0 if fits else 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        if args.plan:
            return print_plan(read_config(args), plan_request(args))
        end = train(read_config(args), allow_unsafe_pickle=args.allow_unsafe_pickle, trace_dir=args.trace)
    except Exception as err:  # what the user can act on is one line; anything else is a bug, with its traceback
        line = one_line(err)
        if line is None:
            raise
        print(line[0], file=sys.stderr)
        return line[1]
    finally:
        main_rank = _leave_process_group()
    if main_rank and end is not None and end.interrupted:  # None: a finished run, run again (said where found)
        logger.warning("interrupted at step %d: loss %.4f (its step line above); checkpoint saved, run the same "
                       "command again to continue", end.step, end.loss)
    elif main_rank and end is not None:
        logger.info("done: final loss %.4f", end.loss)
    return 0


def _leave_process_group() -> bool:
    """Destroy the process group, if any, while the interpreter is whole (gloo's threads racing its
    teardown can abort a finished job); returns whether this was rank 0."""
    if not dist.is_initialized():
        return True
    main_rank = dist.get_rank() == 0
    dist.destroy_process_group()
    return main_rank


if __name__ == "__main__":
    sys.exit(main())
