"""The users' workloads: their model, their DeepSpeed JSON, DeepSpeed and this engine in the same run.

    python bench/user_workloads.py --models nngpt hf_llama --sizes 2.7b \
        --configs bench/configs/zero_infinity.json bench/configs/zero_offload.json \
        --engines deepspeed angelptm --memory-cap 22GB --steps 8

Each (model, size, config, engine) runs in its own process, written the way a DeepSpeed user writes the
script (:func:`train`): ``import deepspeed`` or ``import angelptm as deepspeed`` is the only difference. A
ZeRO-3 config builds the model under ``deepspeed.zero.Init(config_dict_or_path=...)``, as DeepSpeed's docs
and transformers do for large models. ``--set KEY=VALUE`` edits the config for one engine's runs only
(``angelptm:zero_cache.device_steps=0``), to try the settings a user would otherwise have to find.

Steps are timed as a user's loop times them (:func:`timed_steps`): from one loss reaching the host to the next, with
nothing drained outside the timer. The figures are over the last ``--steps`` steps (at least 10 by the protocol)
after ``--warmup-steps`` and, for this engine, its device-step tuning: their median, and their mean with the work the
last one left pending drained and counted (an engine whose host updates run into the next step alternates short and
long steps, which a median hides). What users vary is varied here too: ``--data reused`` trains on one batch every
step, ``fresh`` on a new one; ``--init default`` is PyTorch's init, ``small`` GPT-2's 0.02; ``--build zero_init_bf16``
builds the model under ``deepspeed.zero.Init(dtype=torch.bfloat16)``. A config with ``gradient_clipping`` counts
the measured steps whose global norm exceeded it (``clipped_steps``): a clip row with none clipped measured
something else, and ``--require-clip`` fails it.

Prints one JSON line per run and a table of s/step (median and mean), tokens/s, model TFLOPS (6N + 12 L H S per
token, recompute not counted), the ratio against the anchor engine on the same model, size and config, the clipped
steps, peak device memory, host RSS and disk bytes per step; for this engine also the plan's predicted step floor.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import user_models  # noqa: E402  (bench/ is not a package)

from zero_cache.plan.tuning import MAX_TRIALS, MEASURED_STEPS, RESTARTS, SETTLE_STEPS  # noqa: E402

TUNING_STEPS = 1 + (1 + RESTARTS) * MAX_TRIALS * (SETTLE_STEPS + MEASURED_STEPS)
"""The warm-up and the device-step tuner's trials (:mod:`zero_cache.plan.tuning`: at most MAX_TRIALS counts, started
over at most RESTARTS times where the norm falls under the clip threshold during them, as random tokens' does at 13B).
Not a bound: a norm that falls after the tuning settled starts it over RETUNE_STEPS steps later, which may be inside the
measured steps; the engine's log then says "the device-step tuning starts over", and the JSON line's grad norms say
where the norm fell."""


def edited_config(path: str, edits: list[str], engine: str) -> dict:
    """The JSON at ``path`` with ``[ENGINE:]dotted.key=json_value`` edits for ``engine`` applied."""
    config = json.loads(Path(path).read_text())
    for edit in edits:
        target, _, rest = edit.partition(":") if ":" in edit.split("=")[0] else ("", "", edit)
        if target and target != engine:
            continue
        key, _, value = rest.partition("=")
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node.setdefault(parent, {})
        try:
            node[leaf] = json.loads(value)
        except json.JSONDecodeError:
            node[leaf] = value
    return config


def cap_memory(cap: str | None) -> None:
    """Stand in for a smaller GPU: this process may allocate ``cap`` bytes of it at most."""
    import torch

    if cap and torch.cuda.is_available():
        from zero_cache import parse_bytes

        torch.cuda.set_per_process_memory_fraction(parse_bytes(cap) / torch.cuda.get_device_properties(0).total_memory)


@dataclass(frozen=True, slots=True)
class Workload:
    """What a user's script chooses beyond model and config (the protocol varies each)."""

    steps: int
    """Measured steps: the figures are over these, the last of the run."""
    unmeasured: int
    """Steps before them: warm-up, and this engine's device-step tuning."""
    data: str = "fresh"
    """``fresh``: a new batch of random tokens every step; ``reused``: one batch every step."""
    init: str = "small"
    """``user_models.INITS``."""
    build: str = "plain"
    """``plain``: built where it trains (under ``zero.Init(config_dict_or_path=...)`` for ZeRO-3); ``zero_init_bf16``:
    under ``zero.Init(dtype=torch.bfloat16)``, as large-model scripts do."""


DATA, BUILDS = ("fresh", "reused"), ("plain", "zero_init_bf16")


def build_model(deepspeed: Any, kind: str, size: str, config: dict, workload: Workload, device: Any) -> Any:
    """The user's model as ``workload`` builds it (with ``deepspeed`` this engine or DeepSpeed)."""
    import torch

    zero3 = (config.get("zero_optimization") or {}).get("stage") == 3
    if workload.build == "zero_init_bf16":
        if not zero3:
            raise ValueError("--build zero_init_bf16 needs a ZeRO-3 config (zero.Init partitions the model)")
        with deepspeed.zero.Init(dtype=torch.bfloat16):
            return user_models.build(kind, size, workload.init)
    if zero3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            return user_models.build(kind, size, workload.init)
    return user_models.build(kind, size, workload.init).to(device)


def train(kind: str, size: str, config: dict, engine_name: str, workload: Workload,
          trace_dir: str | None = None) -> dict:
    """A user's training script: build the model, initialize, train on random tokens; returns the timings."""
    import torch

    if engine_name == "torch":
        return train_plain(kind, size, config, workload)
    if engine_name == "deepspeed":
        import deepspeed
    else:
        import angelptm as deepspeed

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.device("meta"):  # the parameter count, without building anything
        num_params = sum(p.numel() for p in user_models.build(kind, size).parameters())
    model = build_model(deepspeed, kind, size, config, workload, device)
    built_s = time.perf_counter() - started
    started = time.perf_counter()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    init_s = time.perf_counter() - started
    print(f"bench: {kind} {size} {engine_name} built in {built_s:.1f} s, initialized in {init_s:.1f} s",
          file=sys.stderr, flush=True)

    total = workload.unmeasured + workload.steps
    # The traced step is written out during the next one's forward, which a trace slows by a second or more: trace the
    # step two before the window, so the write lands in the last unmeasured step.
    trace_at = max(3, total - workload.steps - 2)

    def step(ids: Any, index: int) -> Any:
        if trace_dir and index == trace_at and hasattr(engine, "trace_next_step"):
            engine.trace_next_step(Path(trace_dir) / f"{kind}-{size}")
        loss = user_models.loss_of(engine(input_ids=ids[:, :-1], labels=ids[:, 1:]))
        engine.backward(loss)
        engine.step()
        # Both engines' step computed the global norm; whether it clipped is read after the run: a float() here
        # would wait for backward's end before the next forward is queued, which a user's loop does not.
        norm = engine.get_global_grad_norm()
        norms.append(norm.detach().clone() if isinstance(norm, torch.Tensor) else norm)
        return loss

    norms: list[Any] = []
    finish_pending = getattr(optimizer, "finish_pending", None)  # (this engine's host worker)
    times, losses, disk, drained = timed_steps(step, total, config, size, device, f"{kind} {size} {engine_name}",
                                               data=workload.data, drain=finish_pending)
    norms = [None if norm is None else round(float(norm), 4) for norm in norms]
    result = {**timings(kind, size, engine_name, num_params, times, losses, disk, drained, config, workload.steps),
              **clipped_steps(norms, config.get("gradient_clipping", 0.0), workload.steps),
              "built_s": built_s, "init_s": init_s, "grad_norms": norms, **workload_fields(workload)}
    plan = getattr(optimizer, "plan", None)
    if plan is not None:  # this engine: what its plan predicted the step would cost
        result["plan"] = plan.summary()
        result["predicted_floor_s"] = plan.traffic.seconds
        # beside host_rss_gib: the host bytes per parameter the settled plan holds, and the host tier's counted peak
        # (the warm-up's placement included: zero_cache.plan.host_memory)
        result["host_bytes_per_param_plan"] = round(plan.host_bytes / num_params, 2)
        result["host_bytes_per_param_peak"] = round(optimizer.reports.tier_peaks()["host"] / num_params, 2)
        report = optimizer.report()
        result["per_step_ms"] = {k.removeprefix("zero_cache_").removesuffix("_s"): round(v / total * 1e3)
                                 for k, v in report.items() if k.endswith("_s")}
    return result


def train_plain(kind: str, size: str, config: dict, workload: Workload) -> dict:
    """The protocol's plain-torch anchor: bf16 weights stepped by torch's fused AdamW on the GPU, no fp32 masters."""
    import torch

    torch.manual_seed(0)
    model = user_models.build(kind, size, workload.init).cuda().bfloat16()
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    clip = config.get("gradient_clipping", 0.0)  # (DeepSpeed's default: none)
    norms: list[torch.Tensor] = []

    def step(ids: Any, index: int) -> Any:
        loss = user_models.loss_of(model(input_ids=ids[:, :-1], labels=ids[:, 1:]))
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    total = workload.unmeasured + workload.steps
    times, losses, disk, drained = timed_steps(step, total, config, size, torch.device("cuda"), f"{kind} {size} torch",
                                               data=workload.data)
    rounded = [round(float(norm), 4) for norm in norms]
    return {**timings(kind, size, "torch", num_params, times, losses, disk, drained, config, workload.steps),
            **clipped_steps(rounded, clip, workload.steps), "grad_norms": rounded, **workload_fields(workload)}


def workload_fields(workload: Workload) -> dict:
    """What the result line says of the workload's choices."""
    return {"data": workload.data, "init": workload.init, "build": workload.build}


def clipped_steps(norms: list[float | None], threshold: float, window: int) -> dict:
    """How many of the last ``window`` steps clipped: their global norm (before clipping) exceeded ``threshold``.

    A clip row whose count is 0 measured unclipped steps: the protocol does not let it stand for clipped training
    (:func:`not_a_clip_row`)."""
    measured = [norm for norm in norms[-window:] if norm is not None] if window else []
    clipped = sum(1 for norm in measured if threshold > 0 and norm > threshold)
    return {"clip_threshold": threshold, "clipped_steps": clipped, "norm_range": [min(measured), max(measured)]
            if measured else None}


def not_a_clip_row(result: dict) -> str | None:
    """Why a run with a clip threshold is not a clip row (none of its measured steps clipped), or None."""
    if not result.get("clip_threshold") or result.get("clipped_steps"):
        return None
    norms = result.get("norm_range")
    seen = f"its norms {norms[0]:g}-{norms[1]:g}" if norms else "no norm was reported"
    return (f"not a clip row: none of its {result['measured_steps']} measured steps clipped ({seen}, threshold "
            f"{result['clip_threshold']:g}); use --init default with --data reused, or a lower gradient_clipping")


def disk_bytes() -> tuple[int, int]:
    """(read, written) bytes this process has made the storage layer fetch or send (``/proc/self/io``: every
    thread's, async IO included; reads served from the page cache are not counted); (0, 0) where unknown."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except OSError:
        return 0, 0
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def disk_delta(now: tuple[int, int], before: tuple[int, int]) -> tuple[int, int]:
    """(read, written) bytes between two :func:`disk_bytes` readings."""
    return now[0] - before[0], now[1] - before[1]


def timed_steps(step: Any, steps: int, config: dict, size: str, device: Any, label: str, data: str = "fresh",
                drain: Callable[[], None] | None = None
                ) -> tuple[list[float], list[float], list[tuple[int, int]], tuple[float, tuple[int, int]]]:
    """Run ``step(ids, index)`` ``steps`` times on random tokens (a fresh batch each step, or with ``data="reused"``
    one batch every step); returns each step's seconds, loss and disk bytes, and the seconds and disk bytes of
    ``drain`` (the engine's work still pending after the last step).

    A step is timed as a user's loop times it: from one loss reaching the host to the next, and nothing is drained
    outside that clock. What a step queues after its loss (device steps' copies, host updates) lands in the next
    step's time, and what the last step leaves is drained at the end, timed, and counted in the mean
    (:func:`timings`): every measured step's work is in the figures once, as in a user's run.
    """
    import torch

    if data not in DATA:
        raise ValueError(f"data {data!r}: expected one of {DATA}")
    micro, (seq, vocab) = config["train_micro_batch_size_per_gpu"], _tokens(size)
    generator = torch.Generator(device=device).manual_seed(1)
    reused = torch.randint(0, vocab, (micro, seq + 1), device=device, generator=generator)
    times, losses, disk = [], [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
    last, last_disk = time.perf_counter(), disk_bytes()
    for index in range(steps):
        ids = reused if data == "reused" else torch.randint(0, vocab, (micro, seq + 1), device=device,
                                                            generator=generator)
        losses.append(step(ids, index).item())  # .item() waits for this step's loss
        times.append(time.perf_counter() - last)
        last += times[-1]
        now_disk = disk_bytes()
        disk.append(disk_delta(now_disk, last_disk))
        last_disk = now_disk
        print(f"bench: {label} step {index} {times[-1]:.3f} s loss {losses[-1]:.4f} disk read "
              f"{disk[-1][0] / 2**30:.2f} GiB written {disk[-1][1] / 2**30:.2f} GiB{_retries(device)}", file=sys.stderr,
              flush=True)
    if drain is not None:
        drain()
    if device.type == "cuda":
        torch.cuda.synchronize()
    drained = time.perf_counter() - last, disk_delta(disk_bytes(), last_disk)
    print(f"bench: {label} pending work after the last step {drained[0]:.3f} s, disk read {drained[1][0] / 2**30:.2f} "
          f"GiB written {drained[1][1] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return times, losses, disk, drained


def _retries(device: Any) -> str:
    """", allocator retries N": the CUDA caching allocator's retries so far (each frees its cache and allocates
    again, synchronizing the device: a slow step on a full GPU), or nothing off a GPU."""
    import torch

    if device.type != "cuda":
        return ""
    return f", allocator retries {torch.cuda.memory_stats(device).get('num_alloc_retries', 0)}"


def timings(kind: str, size: str, engine_name: str, num_params: int, times: list[float], losses: list[float],
            disk: list[tuple[int, int]], drained: tuple[float, tuple[int, int]], config: dict, window: int) -> dict:
    """The result line over the last ``window`` steps: their median; their mean with the work still pending after the
    last one added (every step's work counted once: an engine whose steps hand work to the next alternates short and
    long steps, which a median hides); throughput from the median; memory peaks; disk bytes per step (the pending
    work's included)."""
    import torch

    window = min(window, len(times))
    measured = times[-window:]
    drained_s, (drained_read, drained_written) = drained
    step_s = statistics.median(measured)
    mean_step_s = (sum(measured) + drained_s) / window
    layers, hidden = user_models.shape_of(kind, size)
    seq, _ = _tokens(size)
    tokens = config["train_micro_batch_size_per_gpu"] * seq
    flops = tokens * user_models.flops_per_token(num_params, layers, hidden, seq)
    return {"model": kind, "size": size, "engine": engine_name, "params": num_params, "measured_steps": window,
            "step_s": step_s, "mean_step_s": mean_step_s, "pending_s": drained_s,
            "tokens_per_s": tokens / step_s, "tflops": flops / step_s / 1e12, "mean_tflops": flops / mean_step_s / 1e12,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            # ru_maxrss: the process's peak resident set (KiB on Linux), pinned host memory included
            "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "disk_read_gib": (sum(read for read, _ in disk[-window:]) + drained_read) / window / 2**30,
            "disk_written_gib": (sum(written for _, written in disk[-window:]) + drained_written) / window / 2**30,
            "losses": [round(x, 4) for x in losses],
            # every step's seconds, and the slowest after the warm-up against the result (the tuning's cost)
            "times": [round(x, 3) for x in times],
            "slowest_after_warmup": round(max(times[1:], default=step_s) / step_s, 2)}


def _tokens(size: str) -> tuple[int, int]:
    """(sequence length, vocabulary) of a size: the protocol's, or small ones for the CPU test of the harness."""
    return (64, 512) if size == "tiny" else (user_models.SEQ, user_models.VOCAB)


def swap_dirs(config: dict) -> set[Path]:
    """The directories a config swaps to: DeepSpeed's offload nvme_paths and ZeRO-Cache's nvme_path."""
    zero = config.get("zero_optimization") or {}
    offloads = [zero.get("offload_param") or {}, zero.get("offload_optimizer") or {}]
    paths = [o.get("nvme_path") for o in offloads if o.get("device") == "nvme"]
    paths.append((config.get("zero_cache") or {}).get("nvme_path"))
    return {Path(p) for p in paths if p}


def entries(dirs: set[Path]) -> set[Path]:
    """What the directories hold now (those that exist)."""
    return {entry for directory in dirs if directory.is_dir() for entry in directory.iterdir()}


def remove_new_entries(dirs: set[Path], before: set[Path]) -> None:
    """Delete what a run left in its swap directories (a child ends with os._exit, so neither engine's exit hooks
    run), so that the next run has the disk's space and the table's disk bytes are its own."""
    import shutil

    for entry in entries(dirs) - before:
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink(missing_ok=True)


def die_with_parent() -> None:
    """In a child, before it runs: the kernel kills it when its parent dies, so a ``timeout`` around this script
    does not leave a training process behind on the GPU (Linux; elsewhere nothing)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_child(command: list[str]) -> tuple[int, list[str], list[str]]:
    """One run in its own process (its peak memory is its own); its notes are printed as they come."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)
    tail: collections.deque[str] = collections.deque(maxlen=30)
    for line in proc.stderr:
        line = line.rstrip("\n")
        if line.startswith(("bench:", "zero_cache", "angelptm")) or "ZeRO-Cache" in line:
            print(line, flush=True)
        elif "Warning" not in line:
            tail.append(line)
    results = [line for line in proc.stdout.read().splitlines() if line.startswith("RESULT ")]
    return proc.wait(), results, list(tail)


def table(results: list[dict], anchor: str) -> str:
    lines = [f"| model | size | config | engine | params | s/step (median) | mean s/step, pending work in | tokens/s "
             f"| TFLOPS | vs {anchor} | clipped steps | plan floor s | peak GPU GiB | host RSS GiB "
             f"| disk read / written GiB per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = next((a for a in results if a["engine"] == anchor and
                     (a["model"], a["size"], a["config"]) == (r["model"], r["size"], r["config"])), None)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "n/a"
        floor = f"{r['predicted_floor_s']:.3f}" if "predicted_floor_s" in r else ""
        clipped = f"{r['clipped_steps']} of {r['measured_steps']}" if r.get("clip_threshold") else "no clip"
        lines.append(f"| {r['model']} | {r['size']} | {r['config']} | {r['engine']} | {r['params'] / 1e9:.2f}B "
                     f"| {r['step_s']:.3f} | {r['mean_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} "
                     f"| {ratio} | {clipped} | {floor} | {r['peak_gib']:.1f} | {r['host_rss_gib']:.1f} "
                     f"| {r['disk_read_gib']:.2f} / {r['disk_written_gib']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["nngpt"], choices=user_models.MODELS)
    parser.add_argument("--sizes", nargs="+", default=["2.7b"], choices=list(user_models.SHAPES))
    parser.add_argument("--configs", nargs="+", default=[str(ROOT / "bench/configs/zero_infinity.json")])
    parser.add_argument("--engines", nargs="+", default=["deepspeed", "angelptm"])
    parser.add_argument("--anchor", default="deepspeed")
    parser.add_argument("--steps", type=int, default=10, help="measured steps, the last of each run (the protocol: "
                        "at least 10)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="unmeasured steps before them, every engine")
    parser.add_argument("--tuning-steps", type=int, default=TUNING_STEPS,
                        help="unmeasured steps added to this engine's runs for its device-step tuning")
    parser.add_argument("--data", choices=DATA, default="fresh", help="a fresh batch each step, or one reused")
    parser.add_argument("--init", choices=user_models.INITS, default="small", help="the model's init")
    parser.add_argument("--build", choices=BUILDS, default="plain", help="zero_init_bf16: under zero.Init(dtype=bf16)")
    parser.add_argument("--require-clip", action="store_true",
                        help="fail a run with a clip threshold none of whose measured steps clipped")
    parser.add_argument("--memory-cap", help="torch.cuda.set_per_process_memory_fraction to this many bytes")
    parser.add_argument("--set", dest="edits", action="append", default=[],
                        help="[ENGINE:]dotted.key=JSON_VALUE edit of the config (repeatable)")
    parser.add_argument("--trace", help="this engine: write a trace and PNG of the step before the measured ones")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "SIZE", "CONFIG", "ENGINE"), help=argparse.SUPPRESS)
    parser.add_argument("--unmeasured", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")  # the plan, re-plan, trace
        kind, size, config_path, engine_name = args.child
        cap_memory(args.memory_cap)
        workload = Workload(steps=args.steps, unmeasured=args.unmeasured, data=args.data, init=args.init,
                            build=args.build)
        result = train(kind, size, edited_config(config_path, args.edits, engine_name), engine_name, workload,
                       args.trace)
        print("RESULT " + json.dumps({**result, "config": Path(config_path).stem}), flush=True)
        sys.stderr.flush()
        os._exit(0)  # skip the interpreter's teardown (DeepSpeed's and torch's threads)
    # One process per run, as `deepspeed script.py` or torchrun would start it (DeepSpeed reads these).
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, value)
    results, failed = [], 0
    for kind, size, config_path, engine_name in itertools.product(args.models, args.sizes, args.configs, args.engines):
        # This engine settles its device-step count by measuring (zero_cache.plan.tuning): time it after that.
        unmeasured = args.warmup_steps + (args.tuning_steps if engine_name == "angelptm" else 0)
        command = [sys.executable, __file__, "--child", kind, size, config_path, engine_name, "--steps",
                   str(args.steps), "--unmeasured", str(unmeasured), "--data", args.data, "--init", args.init,
                   "--build", args.build]
        command += ["--memory-cap", args.memory_cap] if args.memory_cap else []
        command += [arg for edit in args.edits for arg in ("--set", edit)]
        command += ["--trace", str(Path(args.trace) / Path(config_path).stem)] if args.trace else []
        dirs = swap_dirs(edited_config(config_path, args.edits, engine_name))
        before = entries(dirs)
        returncode, lines, tail = run_child(command)
        remove_new_entries(dirs, before)
        if returncode or not lines:
            print(f"{kind} {size} {Path(config_path).stem} {engine_name}: failed (exit {returncode})\n"
                  + "\n".join(tail), flush=True)
            failed += 1
            continue
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
        print(json.dumps(results[-1]), flush=True)
        why = not_a_clip_row(results[-1]) if args.require_clip else None
        if why:
            print(f"{kind} {size} {Path(config_path).stem} {engine_name}: {why}", flush=True)
            failed += 1
    print("\n" + table(results, args.anchor))
    if failed:  # (the table has the others; the exit status says that not every run gave a row)
        sys.exit(f"{failed} run(s) failed")


if __name__ == "__main__":
    main()
