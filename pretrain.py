"""GPT pretraining from a DeepSpeed-style JSON config: the main job.

    python pretrain.py                      # the tiny default (configs/tiny.json), CPU or GPU
    python pretrain.py --config FILE        # any config
    torchrun --nproc-per-node 2 pretrain.py --config FILE   # data parallel
    torchrun --nproc-per-node 2 pretrain.py --config configs/tiny_autopipe.json   # AutoPipe pipeline

The model comes from the config's "model" section, the tokens from "data" (the shipped
public-domain corpus when no path is given), the loop from "train". A run that finds a checkpoint
in ``train.save_dir`` continues from it; Ctrl-C or SIGTERM finishes the current step, saves, and exits.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import angelptm
import zero_cache
from angelptm import pipeline
from angelptm.config import EngineConfig, load_config, read_config_source
from angelptm.data import TokenDataset, prepare_default_dataset, repeat_batches
from angelptm.distributed import DistContext, init_distributed
from angelptm.errors import CheckpointError, ConfigError
from angelptm.models import build_model
from angelptm.monitor import ThroughputMeter, format_memory, format_tiers, memory_snapshot

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.json"
logger = logging.getLogger("pretrain")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="JSON config (default: configs/tiny.json)")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--save-dir", help="override train.save_dir")
    parser.add_argument("--no-resume", action="store_true", help="start fresh even if save_dir has a checkpoint")
    parser.add_argument("--plan", action="store_true",
                        help="print where ZeRO-Cache would place the model states (or the shortfall) and exit")
    parser.add_argument("--ranks", type=int, default=1,
                        help="with --plan: data-parallel ranks to plan for (each like this machine's GPU)")
    parser.add_argument("--ranks-per-host", type=int,
                        help="with --plan: ranks sharing one host's RAM (default: all of --ranks)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser.parse_args(argv)


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
    return raw


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for messages."""
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def refuse_fresh_start_over_a_run(save_dir: str, ctx: DistContext) -> None:
    """A fresh start (resume off) must not write into a save_dir that already holds another run's checkpoints.

    Its ``global_stepN`` tags would mix with the old run's: ``latest`` would jump between runs and
    pruning would count (or spare) the wrong run's checkpoints.
    """
    latest = Path(save_dir) / "latest"
    if ctx.any_rank(latest.is_file()):
        raise CheckpointError(
            f"{save_dir!r} already holds a checkpoint ({latest} names {read_latest(latest)!r}) and resume is off "
            f"(--no-resume or train.resume=false); starting a new run there would mix its checkpoints with the "
            f"old run's. Pass --save-dir with another directory, or drop --no-resume to continue the old run")


def read_latest(latest: Path) -> str | None:
    try:
        return latest.read_text().strip()
    except OSError:  # another rank sees it, or it went away: the message still names the directory
        return None


def build_dataset(cfg: EngineConfig, ctx: DistContext) -> TokenDataset:
    """The token dataset; the shipped corpus is tokenized by rank 0 while the others wait."""
    prefix = cfg.data.path
    if prefix is None:
        if ctx.is_main:
            prepare_default_dataset(cfg.data.cache_dir)
        ctx.barrier()
        prefix = prepare_default_dataset(cfg.data.cache_dir)  # finds rank 0's copy valid and reuses it
    dataset = TokenDataset(prefix, cfg.data.seq_len or cfg.model.max_seq_len)
    if dataset.vocab_size is not None and dataset.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data: the dataset's vocabulary has {dataset.vocab_size} tokens but model.vocab_size is "
                          f"{cfg.model.vocab_size}; raise model.vocab_size to at least {dataset.vocab_size}")
    return dataset


def step_of(tag: str) -> int | None:
    """N for a ``global_stepN`` tag, else None."""
    digits = tag.removeprefix("global_step")
    return int(digits) if digits != tag and digits.isdigit() else None


def prune_checkpoints(save_dir: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` ``global_stepN`` checkpoints up to the one ``latest`` names; delete older ones.

    Only tags with N <= the step of ``latest`` are candidates: newer ones are not this run's
    checkpoints (another run's, or a save that never became ``latest``) and are left alone, as is
    the ``latest`` one itself and any tag not of the form ``global_stepN``. Without a ``latest``
    naming a ``global_stepN`` tag nothing is deleted.
    """
    root = Path(save_dir)
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    latest_step = step_of(latest) if latest is not None else None
    if latest_step is None:
        return
    steps = sorted((step, p) for p in root.glob("global_step*")
                   if p.is_dir() and (step := step_of(p.name)) is not None and step <= latest_step)
    for _, path in steps[:max(len(steps) - keep_last, 0)]:
        if path.name != latest:
            shutil.rmtree(path, ignore_errors=True)


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


def train(raw: dict) -> float:
    """Run the configured training; returns the last logged loss."""
    ctx = init_distributed()
    cfg = load_config(raw, world_size=ctx.world_size)
    if not cfg.train.resume:
        refuse_fresh_start_over_a_run(cfg.train.save_dir, ctx)
    torch.manual_seed(cfg.seed if cfg.seed is not None else 0)  # model init is reproducible either way
    dataset = build_dataset(cfg, ctx)
    if cfg.autopipe.enabled:  # pipeline parallelism: angelptm/pipeline.py builds the stages and their optimizer
        stop = StopRequest()
        return pipeline.train(cfg, ctx, dataset, stop_requested=lambda: stop.requested,
                              after_save=lambda: prune_checkpoints(cfg.train.save_dir, cfg.train.keep_last))
    model = build_model(cfg.model, moe=cfg.moe)
    weight_decay = cfg.optimizer.weight_decay if cfg.optimizer else 0.0
    engine, _, loader, _ = angelptm.initialize(model=model, model_parameters=model.param_groups(weight_decay),
                                               training_data=dataset, config=cfg)
    save_dir = cfg.train.save_dir
    if cfg.train.resume:
        path, _ = engine.load_checkpoint(save_dir)
        if path and ctx.is_main:
            logger.info("resumed from %s at step %d", path, engine.global_steps)
    if ctx.is_main:
        logger.info("model: %s flavour, %.2fM parameters; %d ranks x micro-batch %d x %d accumulation = %d "
                    "sequences of %d tokens per step; device %s, dtype %s", cfg.model.flavour,
                    model.num_params() / 1e6, ctx.world_size, cfg.batch.micro_batch_size,
                    cfg.batch.gradient_accumulation_steps, cfg.batch.train_batch_size, dataset.seq_len,
                    ctx.device, cfg.precision.dtype)
    return run_loop(engine, cfg, ctx, loader, dataset.seq_len)


def run_loop(engine: angelptm.Engine, cfg: EngineConfig, ctx: DistContext, loader, seq_len: int) -> float:
    batches = repeat_batches(loader)
    meter = ThroughputMeter(engine.module.flops_per_token(seq_len), ctx.device)
    stop = StopRequest()
    tokens_per_step = cfg.batch.train_batch_size * seq_len
    progress = tqdm(total=cfg.train.steps, initial=engine.global_steps, desc="train", unit="step",
                    disable=not ctx.is_main, dynamic_ncols=True)
    loss_sum, loss_count, last_loss = 0.0, 0, float("nan")
    while engine.global_steps < cfg.train.steps and not ctx.any_rank(stop.requested):
        for _ in range(cfg.batch.gradient_accumulation_steps):
            loss = engine(**next(batches))
            engine.backward(loss)
            engine.step()
            loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        meter.add_tokens(tokens_per_step)
        progress.update(1)
        step = engine.global_steps
        if step % cfg.train.log_interval == 0 or step == cfg.train.steps:
            last_loss = mean_over_ranks(loss_sum / loss_count, ctx)
            loss_sum, loss_count = 0.0, 0
            log_metrics(step, last_loss, engine, meter, ctx, cfg.train.steps)
        if step % cfg.train.save_interval == 0 and step < cfg.train.steps:
            save(engine, cfg, ctx)
    progress.close()
    save(engine, cfg, ctx)
    if stop.requested:
        logger.warning("stopped at step %d; run the same command again to continue", engine.global_steps)
    return last_loss


def save(engine: angelptm.Engine, cfg: EngineConfig, ctx: DistContext) -> None:
    engine.save_checkpoint(cfg.train.save_dir)
    if ctx.is_main:
        prune_checkpoints(cfg.train.save_dir, cfg.train.keep_last)


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


def print_plan(raw: dict, ranks: int = 1, ranks_per_host: int | None = None) -> int:
    """``--plan``: lay the model out on the meta device and plan it for every rank, allocating nothing."""
    if ranks < 1 or (ranks_per_host is not None and not 1 <= ranks_per_host <= ranks):
        raise ConfigError(f"--ranks {ranks} --ranks-per-host {ranks_per_host}: need 1 <= ranks-per-host <= ranks")
    cfg = load_config(raw)
    with torch.device("meta"):
        model = build_model(cfg.model, moe=cfg.moe)
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(f"model: {model.num_params() / 1e6:,.1f}M parameters, {cfg.precision.dtype}, device {device}")
    if not cfg.zero_cache.enabled:
        print("zero_cache is not enabled in this config: every rank holds all model states on its device")
        return 0
    try:
        layout, plan = zero_cache.dry_run(shapes, cfg.zero_cache, compute_dtype=cfg.precision.dtype, device=device,
                                          accumulation_steps=cfg.batch.gradient_accumulation_steps,
                                          world_size=ranks, ranks_per_host=ranks_per_host)
    except zero_cache.PlanError as err:
        print(f"does not fit: {err}")
        return 2
    except zero_cache.NvmeSetupError as err:
        print(f"cannot use the NVMe tier: {err}")
        return 2
    who = f"rank 0 of {ranks}: " if ranks > 1 else ""
    print(f"{layout.num_chunks} chunks of {layout.chunk_numel:,} elements ({100 * layout.waste_fraction:.1f}% "
          f"padding)\n{who}{plan.summary()}\n(before the warm-up measures activations; it re-plans after step 1)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        if args.plan:
            return print_plan(read_config(args), args.ranks, args.ranks_per_host)
        loss = train(read_config(args))
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        main_rank = _leave_process_group()
    if main_rank:
        logger.info("done: final loss %.4f", loss)
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
