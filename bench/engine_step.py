"""Step time of the engine (replicated or ZeRO-Cache) against plain PyTorch and DeepSpeed, same model, same run.

    python bench/engine_step.py --sizes 125m 1.3b --modes torch angelptm deepspeed --steps 20
    python bench/engine_step.py --sizes 1.3b --modes zero_cache deepspeed_nvme --anchor deepspeed_nvme \
        --device-budget 12GB --host-budget 4GB --nvme-path /tmp/swap      # optimizer states on disk
    python bench/engine_step.py --sizes 6.9b --modes zero_cache deepspeed_zero3 --anchor deepspeed_zero3 \
        --nproc 1 2                                                       # data parallel over 2 GPUs
    python bench/engine_step.py --sizes 2.7b --modes zero_cache deepspeed_infinity --anchor deepspeed_infinity \
        --memory-cap 22GiB --build-on-host     # a 24 GB GPU: params streamed from the host (ZeRO-Infinity)

Each (size, mode) runs in its own process so peak memory is its own. Model TFLOPS follow the
benchmark protocol: (6N + 12 L H S) x tokens / step time, recompute not counted. Prints one JSON
line per run and a table; ratios are against DeepSpeed measured in the same invocation.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # GPT-2-style shapes; vocab 50304, seq 1024 as in the protocol
    "125m": dict(num_layers=12, hidden_size=768, num_heads=12),
    "350m": dict(num_layers=24, hidden_size=1024, num_heads=16),
    "1.3b": dict(num_layers=24, hidden_size=2048, num_heads=16),
    "2.7b": dict(num_layers=32, hidden_size=2560, num_heads=32),
    "4.4b": dict(num_layers=36, hidden_size=3072, num_heads=24, tie_embeddings=False),  # 4.39B
    "6.9b": dict(num_layers=32, hidden_size=4096, num_heads=32, tie_embeddings=False),
    "8.5b": dict(num_layers=40, hidden_size=4096, num_heads=32, tie_embeddings=False),  # 8.47B
    "10b": dict(num_layers=48, hidden_size=4096, num_heads=32, tie_embeddings=False),  # 10.1B
    "13b": dict(num_layers=40, hidden_size=5120, num_heads=40, tie_embeddings=False),
    "13.7b": dict(num_layers=42, hidden_size=5120, num_heads=40, tie_embeddings=False),
    "16b": dict(num_layers=50, hidden_size=5120, num_heads=40, tie_embeddings=False),
    "18b": dict(num_layers=56, hidden_size=5120, num_heads=40, tie_embeddings=False),
    "19b": dict(num_layers=60, hidden_size=5120, num_heads=40, tie_embeddings=False),
    "20b": dict(num_layers=63, hidden_size=5120, num_heads=40),  # tied embeddings: 20.08B
    "26b": dict(num_layers=41, hidden_size=7168, num_heads=56, tie_embeddings=False),  # 26.0B
    "29b": dict(num_layers=46, hidden_size=7168, num_heads=56, tie_embeddings=False),  # 29.1B
    "30b": dict(num_layers=48, hidden_size=7168, num_heads=56, tie_embeddings=False),  # 30.3B
    "31b": dict(num_layers=49, hidden_size=7168, num_heads=56, tie_embeddings=False),  # 30.9B
    "40b": dict(num_layers=48, hidden_size=8192, num_heads=64, tie_embeddings=False),  # 39.5B
    "50b": dict(num_layers=60, hidden_size=8192, num_heads=64, tie_embeddings=False),  # 49.2B
}
TRACED_STEP = 3
"""With --trace: the step pictured (after the warm-up step and the re-plan it triggers)."""
AIO = {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 4, "single_submit": False, "overlap_events": True}
"""The same aio block for DeepSpeed's NVMe offload and ZeRO-Cache's NVMe tier."""


def build(size: str, checkpointing: bool, construction: Any = None, fp16: bool = False) -> tuple[Any, int, float]:
    """The model in bf16, on the GPU (fast, no host copy), or under ``construction`` (a zero.Init context that
    keeps it off the GPU); its parameter count and model FLOPs per token (from a meta-device twin: a
    partitioning construction leaves the model's own params empty)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from angelptm.pretraining.models import ModelConfig, build_model

    torch.manual_seed(0)
    config = ModelConfig(flavour="gpt2", vocab_size=50304, max_seq_len=1024, dropout=0.0,
                         activation_checkpointing=checkpointing, **SIZES[size])
    with torch.device("meta"):
        twin = build_model(config)
    dtype = torch.float16 if fp16 else torch.bfloat16
    # Built in fp32 and cast, as the earlier runs were (same initial weights), unless the fp32 model would not fit
    # the GPU: 49.2B takes 183 GiB in fp32 against an H200's 139 GiB (the 4-GPU 50b run died of it in its build),
    # so from 40b on it is built in the compute dtype directly (92 GiB at 49.2B).
    fp32_fits = construction is not None or 4 * twin.num_params() < 0.9 * torch.cuda.mem_get_info()[0]
    previous = torch.get_default_dtype()
    if not fp32_fits:
        print(f"bench: {size} built in {dtype} directly: in fp32 it would take "
              f"{4 * twin.num_params() / 2**30:.0f} GiB, the GPU has {torch.cuda.mem_get_info()[0] / 2**30:.0f} GiB "
              "free", file=sys.stderr, flush=True)
        torch.set_default_dtype(dtype)
    try:
        with construction if construction is not None else torch.device("cuda"):
            model = build_model(config)
    finally:
        torch.set_default_dtype(previous)
    if construction is None:  # (the constructions build in the config's dtype)
        model = model.half() if fp16 else model.bfloat16()
    return model, twin.num_params(), twin.flops_per_token(1024)


def cap_memory(cap: str | None) -> None:
    """Stand in for a smaller GPU: this process may allocate ``cap`` bytes of it at most."""
    import torch

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # under torchrun: this rank's GPU
    if cap:
        sys.path.insert(0, str(ROOT))
        from zero_cache import parse_bytes

        torch.cuda.set_per_process_memory_fraction(parse_bytes(cap) / torch.cuda.get_device_properties(0).total_memory)


def run_one(size: str, mode: str, steps: int, micro: int, checkpointing: bool, device_budget: str,
            clip: float, host_budget: str = "auto", nvme_path: str | None = None, memory_cap: str | None = None,
            build_on_host: bool = False, param_home: str = "auto", trace_dir: str | None = None,
            accumulation: int = 1) -> dict:
    """Train ``steps`` steps in this process and return timings. Modes zero_cache_clip and zero_cache_fp16 are
    zero_cache with gradient_clipping 1.0, and with fp16 (dynamic loss scaling) instead of bf16;
    zero_cache_host_adam is zero_cache with every host group updated by the host's Adam (device_steps 0)."""
    import torch

    cap_memory(memory_cap)
    if mode == "zero_cache_clip":
        clip = 1.0
    precision = {"fp16": {"enabled": True}} if mode == "zero_cache_fp16" else {"bf16": {"enabled": True}}
    ds_config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                 **precision, "steps_per_print": 10**9, "gradient_clipping": clip}
    on_host = {"device": "cpu", "pin_memory": True}
    infinity = {**ds_config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {
        "stage": 3, "offload_param": on_host, "offload_optimizer": on_host}}
    zero_cache_config = {**ds_config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "aio": AIO,
                         "zero_cache": {"enabled": True, "device_memory_budget": device_budget,
                                        "host_memory_budget": host_budget, "nvme_path": nvme_path,
                                        "param_home": param_home,
                                        "shard_params": True if mode == "zero_cache_shard" else "auto",
                                        "device_steps": 0 if mode == "zero_cache_host_adam" else "auto"}}
    construction = None
    if build_on_host and mode.startswith("zero_cache"):
        import angelptm

        construction = angelptm.zero.Init(config_dict_or_path=zero_cache_config, remote_device="cpu")
    elif mode == "deepspeed_infinity":  # its own construction: each param partitioned to pinned host memory
        import deepspeed

        construction = deepspeed.zero.Init(config_dict_or_path=infinity, remote_device="cpu", pin_memory=True)
    started = time.perf_counter()
    model, num_params, flops_per_token = build(size, checkpointing, construction, fp16=mode == "zero_cache_fp16")
    print(f"bench: {size} {mode} built in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    started = time.perf_counter()
    if mode == "torch":  # bf16 weights stepped directly: the protocol's "no fp32 master" anchor
        model = model.cuda().bfloat16()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(batch):
            loss = model(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
    elif mode == "angelptm":
        import angelptm

        engine, *_ = angelptm.initialize(model=model, config={**ds_config, "optimizer": {
            "type": "AdamW", "params": {"lr": 1e-4}}})

        def step(batch):
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
            return loss
    elif mode.startswith("zero_cache"):  # zero_cache_shard: params sharded over the ranks (ZeRO-3)
        import logging

        import angelptm

        logging.basicConfig(level=logging.WARNING, format="zero_cache: %(name)s %(message)s")
        logging.getLogger("zero_cache").setLevel(logging.INFO)  # the plan, the IO backend, the re-plan
        engine, optimizer, *_ = angelptm.initialize(model=model, config=zero_cache_config)
        tiers = optimizer.reports.tier_counts()
        # (at attach: the warm-up step's placement, which with activation_memory "auto" on a GPU is the plan's least
        # device footprint; the re-plan after step 1 moves groups, and the result's groups_device_host_nvme is after it)
        print(f"zero_cache: warm-up optimizer groups {tiers.get('device', 0)} device / {tiers.get('host', 0)} host / "
              f"{tiers.get('nvme', 0)} nvme of {sum(tiers.values())}, "
              f"host optimizer {optimizer.host_adam.name}, host chunks update "
              f"{'during' if optimizer.update_in_backward else 'after'} backward", file=sys.stderr)

        def step(batch):
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
            return loss
    else:
        import deepspeed

        if mode == "deepspeed":  # ZeRO-1, everything on the GPU, same fused torch AdamW
            client = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            engine, *_ = deepspeed.initialize(model=model, optimizer=client,
                                              config={**ds_config, "zero_optimization": {"stage": 1}})
        elif mode == "deepspeed_zero3":  # ZeRO-3 without offload, same fused torch AdamW
            client = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            engine, *_ = deepspeed.initialize(model=model, optimizer=client,
                                              config={**ds_config, "zero_optimization": {"stage": 3}})
        elif mode.startswith("deepspeed_nvme"):  # ZeRO-3, optimizer states on NVMe (ZeRO-Infinity)
            # deepspeed_nvme: DeepSpeed's defaults (aio block and buffers); _tuned: our aio block and
            # pipelined swaps, the settings DeepSpeed's docs suggest for throughput.
            tuned = mode == "deepspeed_nvme_tuned"
            offload = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
            offload.update({"buffer_count": 8, "pipeline_read": True, "pipeline_write": True} if tuned else {})
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
                **ds_config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, **({"aio": AIO} if tuned else {}),
                "zero_optimization": {"stage": 3, "offload_optimizer": offload}})
        elif mode == "deepspeed_infinity":  # ZeRO-Infinity: params and optimizer states in pinned host memory
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=infinity)
        else:  # "deepspeed_offload": ZeRO-3 with the optimizer offloaded to DeepSpeedCPUAdam
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
                **ds_config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}})

        def step(batch):
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
            return loss

    print(f"bench: {size} {mode} initialized in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    times, losses = [], []
    # Timed from one step's loss reaching the host to the next step's: the work a step queues after its loss
    # (device steps' copies, host updates, optimizer kernels) lands in the next step's time. (Until 2026-11-25
    # each step was timed from a synchronize before it, which left that work out: see BENCHMARKS.md.)
    torch.cuda.synchronize()
    last = time.perf_counter()
    for index in range(steps):
        if trace_dir and index == TRACED_STEP and mode in ("angelptm", "zero_cache", "zero_cache_shard"):
            engine.trace_next_step(Path(trace_dir) / f"{size}-{mode}")
        ids = torch.randint(0, 50304, (accumulation, micro, 1025), device="cuda", generator=generator)
        for window in ids:  # (engine modes: step() after every micro-batch, the optimizer at the last)
            loss = step({"input_ids": window[:, :-1], "labels": window[:, 1:]})
        losses.append(loss.item())  # .item() waits for this step's loss
        times.append(time.perf_counter() - last)
        last += times[-1]
        print(f"bench: {size} {mode} step {index} {times[-1]:.2f} s loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
    step_s = statistics.median(times[3:])
    extra = {}
    if mode.startswith("zero_cache"):
        report = optimizer.report()
        seconds = {k.removeprefix("zero_cache_").removesuffix("_s"): v for k, v in report.items() if k.endswith("_s")}
        print("zero_cache: per step " + ", ".join(f"{k} {v / steps * 1e3:.0f} ms" for k, v in seconds.items())
              + f"; moved per step d2h {report['zero_cache_d2h_bytes'] / steps / 2**30:.2f} GiB, "
              f"h2d {report['zero_cache_h2d_bytes'] / steps / 2**30:.2f} GiB, "
              f"nvme read {report.get('zero_cache_nvme_read_bytes', 0) / steps / 2**30:.2f} GiB, "
              f"nvme write {report.get('zero_cache_nvme_write_bytes', 0) / steps / 2**30:.2f} GiB", file=sys.stderr)
        reports = optimizer.reports
        tiers, usage, homes = reports.tier_counts(), optimizer.tier_usage(), reports.param_home_counts()
        extra = {"groups_device_host_nvme": [tiers.get(t, 0) for t in ("device", "host", "nvme")],
                 "nvme_gib": usage["nvme"][0] / 2**30 if "nvme" in usage else 0,
                 "overlap": report.get("zero_cache_overlap"), "in_backward": optimizer.update_in_backward,
                 "params_sharded": optimizer.params_sharded,
                 "param_homes_device_host": [homes.get(t, 0) for t in ("device", "host")],
                 "planned_device_gib": usage["device"][1] / 2**30,
                 "device_stepped_groups": len(optimizer.device_stepped),
                 **{name: report[f"zero_cache_{name}"] for name in optimizer.reports.counts}}
        print("zero_cache: " + ", ".join(f"{name} {extra[name]}" for name in optimizer.reports.counts)
              + f" in {steps} steps", file=sys.stderr)
        gathered = optimizer.exchange.gathered if optimizer.exchange is not None else None
        if gathered is not None:  # all-gathers per step of each group (forward, recompute, backward)
            extra["gathers_per_group_step"] = gathered.gathers / steps / sum(homes.values())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = accumulation * micro * 1024 * world_size  # every rank's micro-batches: the global batch
    return {"size": size, "mode": mode, "ranks": world_size, "params": num_params, "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "tflops": tokens * flops_per_token / step_s / 1e12,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            # ru_maxrss: the process's peak resident set (KiB on Linux), pinned host memory included
            "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "losses": [round(loss, 3) for loss in losses], **extra}


FIRST_ERROR_LINES = 40
"""Of a failed child's stderr, this many lines from its first traceback are kept beside the tail: under torchrun
the tail is the launcher's summary, and the failing rank's traceback comes before it."""


def run_child(command: list[str]) -> tuple[int, list[str], list[str]]:
    """Run one (size, mode) child; its notes ("zero_cache: ...", "bench: ...") are printed as they come, so a
    run cut at its time limit still shows how far it got. Returns its exit status, RESULT lines and the stderr
    to show if it failed: the first traceback's first lines (the root cause), then the last 25 lines."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=25)
    first_error: list[str] = []
    open_ = True
    for line in proc.stderr:
        line = line.rstrip("\n")
        if line.startswith(("zero_cache:", "bench:")):
            print(line, flush=True)
            continue
        if not first_error and line.startswith("Traceback") or 0 < len(first_error) < FIRST_ERROR_LINES and open_:
            first_error.append(line)  # (warnings included: they may be part of it)
            # the traceback ends at its exception's line: the first unindented one after the frames
            open_ = len(first_error) == 1 or line[:1].isspace() or line.startswith(("During handling", "The above"))
        if "Warning" not in line:
            tail.append(line)
    results = [line for line in proc.stdout.read().splitlines() if line.startswith("RESULT ")]
    shown = ["-- first traceback --", *first_error, "-- last lines --"] if first_error else []
    return proc.wait(), results, shown + list(tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["125m", "1.3b"], choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["torch", "angelptm", "deepspeed"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per step (engine modes)")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--device-budget", default="auto", help="zero_cache.device_memory_budget for zero_cache")
    parser.add_argument("--host-budget", default="auto", help="zero_cache.host_memory_budget for zero_cache")
    parser.add_argument("--nvme-path", help="swap directory for zero_cache's NVMe tier and deepspeed_nvme")
    parser.add_argument("--gradient-clipping", type=float, default=0.0)
    parser.add_argument("--anchor", default="deepspeed", help="mode the ratios are taken against")
    parser.add_argument("--nproc", nargs="+", type=int, default=[1],
                        help="run each mode on each of these GPU counts (torchrun; same micro-batch per GPU)")
    parser.add_argument("--memory-cap",
                        help="torch.cuda.set_per_process_memory_fraction to this many bytes (every mode)")
    parser.add_argument("--build-on-host", action="store_true",
                        help="zero_cache: build under zero.Init(remote_device=cpu)")
    parser.add_argument("--param-home", default="auto", help="zero_cache.param_home")
    parser.add_argument("--trace", help="engine modes: write a trace and PNG of one step under this directory")
    parser.add_argument("--child", nargs=2, metavar=("SIZE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        # record: under torchrun, a rank's exception goes to its error file, so the launcher's summary names it
        from torch.distributed.elastic.multiprocessing.errors import record

        result = record(run_one)(*args.child, args.steps, args.micro, not args.no_checkpointing, args.device_budget,
                                 args.gradient_clipping, args.host_budget, args.nvme_path, args.memory_cap,
                                 args.build_on_host, args.param_home, args.trace, args.accumulation)
        if os.environ.get("RANK", "0") == "0":
            print("RESULT " + json.dumps(result))
        # Leave without the interpreter's teardown, where torch's communication threads can still be going
        # down and abort a finished run ("terminate called without an active exception", SIGABRT).
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    results = []
    for size, mode, nproc in itertools.product(args.sizes, args.modes, args.nproc):
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        "--standalone", "--nproc-per-node", str(nproc)]
        command = [*launcher, __file__, "--child", size, mode, "--steps", str(args.steps),
                   "--micro", str(args.micro), "--accumulation", str(args.accumulation),
                   "--device-budget", args.device_budget,
                   "--gradient-clipping", str(args.gradient_clipping), "--host-budget", args.host_budget]
        command += ["--no-checkpointing"] if args.no_checkpointing else []
        command += ["--nvme-path", args.nvme_path] if args.nvme_path else []
        command += ["--memory-cap", args.memory_cap] if args.memory_cap else []
        command += ["--build-on-host"] if args.build_on_host else []
        command += ["--param-home", args.param_home]
        command += ["--trace", args.trace] if args.trace else []
        returncode, lines, tail = run_child(command)
        if returncode or not lines:
            print(f"{size} {mode} x{nproc}: failed (exit {returncode})\n" + "\n".join(tail), flush=True)
            continue
        result = json.loads(lines[-1].removeprefix("RESULT "))
        results.append(result)
        print(json.dumps(result), flush=True)
    print(f"\n| size | mode | GPUs | params | step s | tokens/s | TFLOPS | vs {args.anchor} | scaling vs 1 GPU "
          "| peak GPU GiB | host RSS GiB (rank 0) |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        same = [a for a in results if a["size"] == r["size"]]
        anchor = next((a for a in same if a["mode"] == args.anchor and a["ranks"] == r["ranks"]), None)
        ratio = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}x" if anchor else "n/a"
        single = next((a for a in same if a["mode"] == r["mode"] and a["ranks"] == 1), None)
        # Scaling efficiency: throughput on W GPUs over W times the single GPU's, same per-GPU batch.
        scaling = f"{r['tokens_per_s'] / (r['ranks'] * single['tokens_per_s']):.0%}" if single else "n/a"
        print(f"| {r['size']} | {r['mode']} | {r['ranks']} | {r['params'] / 1e6:.0f}M | {r['step_s']:.3f} "
              f"| {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {ratio} | {scaling} | {r['peak_gib']:.1f} "
              f"| {r['host_rss_gib']:.1f} |")


if __name__ == "__main__":
    main()
