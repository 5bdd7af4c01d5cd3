"""AutoPipe's split against the uniform-layer and parameter-count splits: same model, same job, same batches.

    torchrun --nproc-per-node 2 bench/autopipe_split.py --log-file autopipe_split.log            # 2 GPUs, defaults
    torchrun --nproc-per-node 2 bench/autopipe_split.py --device cpu --tiny --log-file /tmp/a.log  # CPU check (gloo)

Default model: Llama-style GPT, vocabulary 256k (untied embedding and head), hidden 2048, 16 layers, seq 2048,
micro-batch 2, 8 micro-batches per 1F1B flush, bf16 with fp32 master weights (angelptm's
MixedPrecisionOptimizer, fused AdamW). The LM head and its loss cost about ten blocks, so a by-layer split
leaves the last stage slowest. Rank 0 profiles the ops; every rank plans the three splits; each split is built
on torch.distributed.pipelining, its chunks timed alone on their own rank (CUDA events), then trained for
``--steps`` timed steps after ``--warmup-steps``. The log gives step time, tokens/s, ratios, and predicted
against measured per-stage compute time.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from angelptm.engine.mixed_precision import MixedPrecisionOptimizer  # noqa: E402
from angelptm.pretraining.models import ModelConfig, build_model  # noqa: E402
from autopipe.cost import CostSettings  # noqa: E402
from autopipe.graph import trace  # noqa: E402
from autopipe.profile import Profile  # noqa: E402
from autopipe.profiler import profile_graph  # noqa: E402
from autopipe.runtime import PipelineLayout, PipelineRunner  # noqa: E402
from autopipe.search import plan_with_baselines  # noqa: E402

METHODS = ("uniform-layers", "parameters", "auto")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-file", required=True, help="write the report (and a JSON line per split) here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small model for a CPU check of the whole path")
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--max-cut-tensors", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--profile-repeats", type=int, default=5)
    args = parser.parse_args()
    if args.tiny:
        args.vocab, args.hidden, args.layers, args.heads, args.seq = 8192, 64, 4, 4, 64
        args.micro_batch, args.microbatches, args.steps, args.warmup_steps = 2, 4, 3, 1
        args.profile_repeats = min(args.profile_repeats, 3)
    return args


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=30))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    return dist.get_rank(), dist.get_world_size(), device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_splits(args, model, device) -> tuple:
    """Trace on every rank, profile on rank 0, and plan the three splits identically everywhere."""
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    example = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].contiguous()}
    graph = trace(model, example, "labels")
    holder = [None]
    if dist.get_rank() == 0:
        start = time.perf_counter()
        holder = [profile_graph(graph, example, warmup=2, repeats=args.profile_repeats).to_json()]
        print(f"profiled {len(graph.ops)} ops in {time.perf_counter() - start:.1f} s", flush=True)
    dist.broadcast_object_list(holder, src=0)
    profile = Profile.from_json(holder[0])
    settings = CostSettings(num_stages=dist.get_world_size(), num_microbatches=args.microbatches,
                            schedule=args.schedule)
    report = plan_with_baselines(profile.to_chain(args.max_cut_tensors), settings)
    units = profile.unit_op_starts(args.max_cut_tensors)
    plans = {p.method: p for p in (report.auto, *report.baselines)}
    missing = [m for m in METHODS if m not in plans]
    if missing:  # e.g. fewer layer starts than stages: that baseline cannot split on layer boundaries
        raise SystemExit(f"no {', '.join(missing)} split of {args.layers} layers into {dist.get_world_size()} stages; "
                         "use more --layers")
    return graph, example, profile, report, {m: [units[u] for u in plans[m].stage_starts] for m in METHODS}, plans


def build(args, device: torch.device) -> torch.nn.Module:
    """The benchmark model, from the same seed every time (every split starts from the same weights)."""
    torch.manual_seed(0)
    config = ModelConfig(flavour="llama", vocab_size=args.vocab, max_seq_len=args.seq, num_layers=args.layers,
                         hidden_size=args.hidden, num_heads=args.heads, tie_embeddings=False)
    with torch.device(device):
        return build_model(config).to(torch.bfloat16 if device.type == "cuda" else torch.float32)


def run_split(args, example, op_starts, layout, rank, device) -> dict:
    """Build one split on a fresh model, time its chunks alone, then train it; returns this rank's measurements."""
    graph = trace(build(args, device), example, "labels")  # same op names as the profiled trace
    runner = PipelineRunner(graph, op_starts, layout, rank, device, schedule=args.schedule,
                            num_microbatches=args.microbatches, loss_scale=1.0 / args.microbatches)
    chunk_s = runner.measure_chunk_times_s({"input_ids": example["input_ids"]}, example["labels"],
                                           repeats=args.profile_repeats)
    named = runner.named_parameters()
    # A stage may hold no parameters (e.g. only the loss, at 4 stages): a param group may be empty, a list may not.
    inner = torch.optim.AdamW([{"params": [p for _, p in named]}], lr=1e-4,
                              fused=(device.type == "cuda" and bool(named)) or None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as build() makes the model
    optimizer = MixedPrecisionOptimizer(inner, {id(p): name for name, p in named}, dtype)
    optimizer.zero_grad()  # the chunk timing left gradients behind
    grad_views = dict(zip(optimizer.names, optimizer.grad_views))
    rows = args.micro_batch * args.microbatches
    generator = torch.Generator(device).manual_seed(2)
    batches = [torch.randint(0, args.vocab, (rows, args.seq + 1), device=device, generator=generator)
               for _ in range(2)]
    step_s, losses = [], []
    for step in range(args.warmup_steps + args.steps):
        tokens = batches[step % len(batches)]
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        loss = runner.step({"input_ids": tokens[:, :-1]}, tokens[:, 1:].contiguous())
        runner.sync_tied_gradients(lambda name, _: grad_views[name])
        optimizer.step()
        synchronize(device)
        if step >= args.warmup_steps:
            step_s.append(time.perf_counter() - start)
        if loss is not None:
            losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    result = {"rank": rank, "chunk_s": chunk_s, "step_s": statistics.median(step_s), "loss": losses[-1:] or None,
              "peak_bytes": peak}
    del runner, optimizer, inner, graph
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def report_lines(args, plans, splits, results) -> list[str]:
    """The table of the three splits, then predicted against measured stage compute."""
    tokens = args.micro_batch * args.microbatches * args.seq
    step = {m: max(r["step_s"] for r in results[m]) for m in METHODS}
    lines = [f"model: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, seq {args.seq}, micro-batch "
             f"{args.micro_batch} x {args.microbatches} ({args.schedule}), {len(results['auto'])} stages, "
             f"device {args.device}",
             f"{'split':<16} {'op starts':<14} {'step ms':>9} {'tokens/s':>10} {'auto speedup':>12} "
             f"{'pred step ms':>12} {'peak GiB':>9}"]
    for m in METHODS:
        lines.append(f"{m:<16} {str(splits[m]):<14} {step[m] * 1e3:>9.1f} {tokens / step[m]:>10,.0f} "
                     f"{step[m] / step['auto']:>11.3f}x {plans[m].step_time_s * 1e3:>12.1f} "
                     f"{max(r['peak_bytes'] for r in results[m]) / 2**30:>9.2f}")
    lines.append(f"measured throughput ratio auto / uniform-layers = {step['uniform-layers'] / step['auto']:.3f}, "
                 f"auto / parameters = {step['parameters'] / step['auto']:.3f}")
    lines.append(f"{'split':<16} {'stage':>5} {'pred fwd+bwd ms':>15} {'measured ms':>11} {'error':>7}")
    errors = []
    for m in METHODS:
        for r in sorted(results[m], key=lambda r: r["rank"]):
            (fwd, bwd), = r["chunk_s"]
            predicted = plans[m].stages[r["rank"]].forward_s + plans[m].stages[r["rank"]].backward_s
            error = (predicted - (fwd + bwd)) / (fwd + bwd)
            errors.append(abs(error))
            lines.append(f"{m:<16} {r['rank']:>5} {predicted * 1e3:>15.2f} {(fwd + bwd) * 1e3:>11.2f} {error:>+7.1%}")
    lines.append(f"largest |predicted - measured| / measured stage time: {max(errors):.1%}")
    return lines


def main() -> None:
    args = parse_args()
    rank, world, device = setup(args)
    graph, example, profile, report, splits, plans = plan_splits(args, build(args, device), device)
    del graph  # each split traces its own fresh model
    gc.collect()
    if rank == 0:
        print(profile.top_ops_table(10), report.format(), sep="\n", flush=True)
    layout = PipelineLayout(world_size=world, num_stages=world)
    results = {}
    for method in METHODS:
        mine = run_split(args, example, splits[method], layout, rank, device)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        results[method] = gathered
    if rank == 0:
        lines = report_lines(args, plans, splits, results)
        text = "\n".join([report.format(), *lines])
        print(text, flush=True)
        with open(args.log_file, "w") as handle:
            handle.write(text + "\n")
            for method in METHODS:
                handle.write(json.dumps({"split": method, "op_starts": splits[method], "ranks": results[method],
                                         "predicted_step_s": plans[method].step_time_s}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
