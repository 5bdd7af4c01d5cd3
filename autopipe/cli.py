"""``python -m autopipe``: profile a model to JSON, and plan a split from a profile.

    python -m autopipe profile --factory angelptm.pretraining.pipeline_parallel:profile_target \\
        --factory-arg configs/tiny_autopipe.json \\
        --out profile.json [--device cuda] [--warmup 2] [--repeats 5] [--top 15]
    python -m autopipe plan --profile profile.json --num-stages 2 --num-microbatches 8 [--schedule 1f1b] \\
        [--memory-limit-gib 80] [--bandwidth-gbs 50] [--png timeline.png]

The factory is ``module:function``, called as ``function(factory_arg, device)`` and returning
``(module, inputs, target_name)``: the model on ``device``, one micro-batch of keyword inputs, and the
keyword of the target. AutoPipe itself knows no model; the factory names one.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from autopipe.config import SCHEDULES, AutoPipeConfig
from autopipe.cost import CostSettings
from autopipe.profile import Profile
from autopipe.profiler import profile_module
from autopipe.search import plan_with_baselines
from autopipe.timeline import draw_png

DEFAULTS = AutoPipeConfig()
DESCRIPTION = "Profile a model's ops to JSON, and plan a pipeline split from a profile."
EPILOG = """examples:
  python -m autopipe profile --factory angelptm.pretraining.pipeline_parallel:profile_target \\
      --factory-arg configs/tiny_autopipe.json --out profile.json
  python -m autopipe plan --profile profile.json --num-stages 2 --num-microbatches 8 --png timeline.png

The factory is module:function, called as function(factory_arg, device) and returning (module, inputs,
target_name): the model on the device, one micro-batch of keyword inputs, and the keyword of the target.
AutoPipe itself knows no model; the factory names one."""
"""The help text (``--help`` prints it as written: plain text, not this module's reST docstring)."""


def load_factory(spec: str):
    """The callable named by ``module:function``.

    Raises:
        ValueError: malformed spec, missing module or function.
    """
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"--factory={spec!r}: expected 'module:function', "
                         "e.g. 'angelptm.pretraining.pipeline_parallel:profile_target'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--factory={spec!r}: cannot import {module_name!r}: {err}") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ValueError(f"--factory={spec!r}: {module_name} has no function {function_name!r}")
    return factory


def run_profile(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    module, inputs, target_name = load_factory(args.factory)(args.factory_arg, device)
    _, profile = profile_module(module, inputs, target_name, warmup=args.warmup, repeats=args.repeats)
    profile.save(args.out)
    print(profile.top_ops_table(args.top))
    print(f"wrote {args.out}: {len(profile.ops)} ops, {len(profile.cut_positions(DEFAULTS.max_cut_tensors))} cut "
          f"positions with <= {DEFAULTS.max_cut_tensors} tensors crossing")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    profile = Profile.load(args.profile)
    limit = args.memory_limit_gib * 2**30 if args.memory_limit_gib is not None else None
    config = AutoPipeConfig(num_stages=args.num_stages, num_microbatches=args.num_microbatches,
                            schedule=args.schedule, virtual_stages_per_rank=args.virtual_stages,
                            stage_memory_limit_bytes=int(limit) if limit is not None else None,
                            link_bandwidth_bytes_per_s=args.bandwidth_gbs * 1e9,
                            state_bytes_per_param=args.state_bytes_per_param, max_cut_tensors=args.max_cut_tensors,
                            recompute=args.recompute)
    report = plan_with_baselines(profile.to_chain(config.max_cut_tensors), CostSettings.from_config(config))
    units = profile.unit_op_starts(config.max_cut_tensors)
    print(report.format())
    for index, unit in enumerate(report.auto.stage_starts):
        op = profile.ops[units[unit]]
        print(f"stage {index} starts at op {units[unit]} ({op.name}, module {op.module or '<root>'})")
    if args.png:
        flush_s = draw_png(report.auto, config.num_microbatches, config.schedule, args.png)
        print(f"wrote {args.png}: simulated flush {flush_s * 1e3:.3f} ms")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m autopipe", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prof = commands.add_parser("profile", help="trace and time a model's ops; write the profile JSON")
    prof.add_argument("--factory", required=True, help="module:function returning (module, inputs, target_name)")
    prof.add_argument("--factory-arg", default=None, help="string handed to the factory (e.g. a config path)")
    prof.add_argument("--out", required=True, help="profile JSON to write")
    prof.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    prof.add_argument("--warmup", type=int, default=DEFAULTS.profile_warmup)
    prof.add_argument("--repeats", type=int, default=DEFAULTS.profile_repeats)
    prof.add_argument("--top", type=int, default=15, help="ops to list")
    plan = commands.add_parser("plan", help="search the split of a profile and compare with by-layer splits")
    plan.add_argument("--profile", required=True)
    plan.add_argument("--num-stages", type=int, default=DEFAULTS.num_stages)
    plan.add_argument("--num-microbatches", type=int, default=DEFAULTS.num_microbatches)
    plan.add_argument("--schedule", choices=SCHEDULES, default=DEFAULTS.schedule)
    plan.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved)")
    plan.add_argument("--memory-limit-gib", type=float, default=None, help="per-rank cap (default: none)")
    plan.add_argument("--bandwidth-gbs", type=float, default=DEFAULTS.link_bandwidth_bytes_per_s / 1e9)
    plan.add_argument("--state-bytes-per-param", type=float, default=DEFAULTS.state_bytes_per_param)
    plan.add_argument("--max-cut-tensors", type=int, default=DEFAULTS.max_cut_tensors)
    plan.add_argument("--recompute", action="store_true", help="stage-level activation checkpointing")
    plan.add_argument("--png", default=None, help="draw the predicted timeline of one flush (needs matplotlib)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input, with the message on stderr)."""
    args = parse_args(argv)
    try:
        return run_profile(args) if args.command == "profile" else run_plan(args)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
