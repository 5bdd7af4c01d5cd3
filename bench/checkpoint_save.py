"""Checkpoints beside training on the GPU: the save's stall, its bandwidth against the disk's, host RSS, and whether a
resumed run lies within the run-to-run spread (issue 52, items 1 and 2).

    python bench/checkpoint_save.py                        # the 2.7B capped row (22 GB cap), on 1x H200
    python bench/checkpoint_save.py --model 1.3b           # where the disk holds less
    python bench/checkpoint_save.py --quick                # a tiny model on CPU (the harness's test)

One run, in this order, each training part in its own process (bench/user_workloads.py builds the user's torch.nn
GPT under the ZeRO-Infinity JSON, bench/configs/, as the regression matrix's capped rows do):

a) the disk: ``--disk-gb`` written with ``os.write`` and fsynced, then read back after ``posix_fadvise(DONTNEED)``
   dropped it from the page cache: sequential write and read GB/s in ``--save-dir``;
b) run A: ``--steps`` steps with ``save_checkpoint(background=True)`` every ``--save-every``. Per save: its blocking
   time (waiting for the previous save, then until ``save_checkpoint`` returns), its write time (call to published)
   and bytes, hence GB/s and the fraction of the disk's write bandwidth; the stall (:func:`save_stall`: the blocking
   time plus the step-time excess of the steps its write overlaps, over the median step without a save) as a fraction
   of 100 steps' time, the protocol's one save per 100 steps; host RSS (VmRSS every 0.2 s) before, at its peak
   during, and after the saves. The previous checkpoint is deleted before each save (two 2.7B checkpoints, 2 x 39 GB,
   do not fit a 64 GiB disk); the last one stays for c);
c) run C, a fresh process: ``load_checkpoint`` of A's last checkpoint (its files dropped from the page cache first):
   seconds, GB/s against the disk's read bandwidth; host RSS before and after the load (what the load keeps), after
   it against A's at the same point (built, before the first step) and A's steady RSS, and during the steps after it,
   on the same data as A's, against A's steady RSS. A fresh process's RSS before its first step is not a steady
   run's: on a GPU the warm-up step runs under the plan's least device footprint (``zero_cache.attach``), so the
   optimizer states the re-plan after it moves to the device sit in host memory until then, loaded or not; the
   target is therefore on what the load adds and on the RSS of the steps after it;
d) run B, a fresh process: the same steps as A without saves. The spread of the GPU's nondeterminism is
   max |loss A - loss B| over the steps C ran; C is "bit-exact", "within noise" (max |loss C - loss A| <= spread)
   or "outside noise".

Every run has the same seed and the same data (step i's batch from its own generator seeded with i). The device-step
tuner is off (``zero_cache.device_steps=0``; ``--set zero_cache.device_steps=auto`` turns it on): its trials vary the
step time over tens of steps, which would read as save stalls. Prints one JSON line per measurement and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import user_models  # noqa: E402  (bench/ is not a package)
import user_workloads  # noqa: E402

DEFAULT_CONFIG = ROOT / "bench" / "configs" / "zero_infinity.json"
DEFAULT_EDITS = ["zero_cache.device_steps=0", "gradient_clipping=10000.0"]
"""The tuner off (see the module's docstring); the norm computed and never clipped (the matrix's unclipped rows)."""
CHECKPOINT_BYTES_PER_PARAM = 14
"""fp32 master, exp_avg and exp_avg_sq (12 B) and the bf16 weights (2 B): 39 GB at 2.7B."""
STALL_TARGET, BANDWIDTH_TARGET, RSS_TARGET_GIB = 0.05, 0.70, 2.0
"""Issue 52's targets: stall at most 5% of 100 steps, save and load at least 70% of the disk's bandwidth, host RSS
during a save and after a load within 2 GiB of the steady run's."""


def rss_bytes() -> int:
    """This process's resident set now (VmRSS), pinned host memory included."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


class Monitor:
    """A thread sampling RSS every ``interval_s`` and noting when the engine's save in the background ends."""

    def __init__(self, engine: Any = None, interval_s: float = 0.2) -> None:
        self.engine, self.interval_s = engine, interval_s
        self.samples: list[tuple[float, int]] = []
        self.watched: dict | None = None
        """The save in flight: its ``done`` is set when the engine's writer has finished."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_sample = 0.0
        while not self._stop.is_set():
            now = time.perf_counter()
            watched = self.watched
            if watched is not None and "done" not in watched and not self.engine.saving_in_background:
                watched["done"] = now
            if now - last_sample >= self.interval_s:
                self.samples.append((now, rss_bytes()))
                last_sample = now
            self._stop.wait(0.01)

    def watch(self, save: dict) -> None:
        """Note when ``save`` (just returned from ``save_checkpoint``) is published."""
        self.watched = save

    def between(self, start: float, end: float) -> list[int]:
        return [rss for at, rss in self.samples if start <= at <= end]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def disk_bandwidth(directory: Path, num_bytes: int, block_bytes: int = 64 << 20) -> dict:
    """Sequential write (``os.write`` then fsync) and read (after dropping the file from the page cache) GB/s."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".bench-disk"
    block = os.urandom(min(block_bytes, num_bytes))
    blocks = max(1, num_bytes // len(block))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        for _ in range(blocks):
            os.write(fd, block)
        os.fsync(fd)
        write_s = time.perf_counter() - started
    finally:
        os.close(fd)
    written = blocks * len(block)
    drop_page_cache(path)
    buffer = bytearray(len(block))
    with open(path, "rb", buffering=0) as handle:
        started = time.perf_counter()
        while handle.readinto(buffer):
            pass
        read_s = time.perf_counter() - started
    path.unlink()
    usage = shutil.disk_usage(directory)
    return {"measure": "disk", "dir": str(directory), "bytes": written, "write_gbps": written / write_s / 1e9,
            "read_gbps": written / read_s / 1e9, "disk_total_gb": usage.total / 1e9, "disk_free_gb": usage.free / 1e9}


def drop_page_cache(path: Path) -> None:
    """Drop a file's (clean) pages from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def save_stall(steps: list[tuple[float, float]], baseline_s: float, *, called: float, returned: float,
               done: float, blocking_s: float) -> dict:
    """A save's cost to training: its blocking time, plus the step-time excess over ``baseline_s`` of the steps
    (``(start, end)`` each, clocked without the save call) whose interval overlaps its write (``returned`` to
    ``done``); the excess summed over those steps, at least 0.

    Returns:
        ``stall_s``, ``excess_s``, ``overlapped_steps``, and ``stall_fraction``: the stall over 100 steps' time
        at ``baseline_s`` (one save per 100 steps).
    """
    overlapped = [(start, end) for start, end in steps if start < done and end > returned]
    excess = max(0.0, sum(end - start - baseline_s for start, end in overlapped))
    stall = blocking_s + excess
    return {"stall_s": stall, "excess_s": excess, "overlapped_steps": len(overlapped),
            "stall_fraction": stall / (100 * baseline_s), "write_s": done - called}


def baseline_step_s(steps: list[tuple[float, float]], saves: list[dict], warmup: int) -> float:
    """The median step time of the steps after ``warmup`` that overlap no save's write."""
    quiet = [end - start for index, (start, end) in enumerate(steps) if index >= warmup and not any(
        start < save["done"] and end > save["called"] for save in saves)]
    if not quiet:  # (every step overlapped a save: the steps after the warm-up, all of them)
        quiet = [end - start for start, end in steps[warmup:]] or [end - start for start, end in steps]
    return statistics.median(quiet)


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """This engine with the user's GPT under the JSON (bench/user_workloads.py's builders); (engine, device, config)."""
    import torch

    import angelptm

    user_workloads.cap_memory(args.memory_cap)
    config = user_workloads.edited_config(args.config, DEFAULT_EDITS + args.edits, "angelptm")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    workload = user_workloads.Workload(steps=args.steps, unmeasured=0)
    model = user_workloads.build_model(angelptm, "nngpt", args.model, config, workload, device)
    engine, _, _, _ = angelptm.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, device, config


def batch(index: int, config: dict, size: str, device: Any) -> Any:
    """Step ``index``'s tokens: the same in every run, whichever step it resumes at."""
    import torch

    seq, vocab = user_workloads._tokens(size)
    generator = torch.Generator().manual_seed(1_000 + index)
    return torch.randint(0, vocab, (config["train_micro_batch_size_per_gpu"], seq + 1), generator=generator).to(device)


def train_steps(engine: Any, config: dict, args: argparse.Namespace, first: int, last: int, *, monitor: Monitor,
                saves: list[dict] | None = None) -> tuple[list[float], list[tuple[float, float]]]:
    """Steps ``first``..``last`` (1-based) with a background save after every ``--save-every``-th before ``last``
    (when ``saves`` is a list): the losses and each step's (start, end), clocked without the save calls."""
    losses, steps = [], []
    save_dir = Path(args.save_dir)
    clock = time.perf_counter()
    for index in range(first, last + 1):
        ids = batch(index, config, args.model, engine.device)
        loss = user_models.loss_of(engine(input_ids=ids[:, :-1], labels=ids[:, 1:]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        steps.append((clock, time.perf_counter()))
        clock = steps[-1][1]
        print(f"bench: step {index} {clock - steps[-1][0]:.3f} s loss {losses[-1]:.4f} rss "
              f"{rss_bytes() / 2**30:.1f} GiB", file=sys.stderr, flush=True)
        if saves is not None and index % args.save_every == 0 and index < last:
            saves.append(background_save(engine, save_dir, index, args.max_staged_chunks, monitor))
            clock = time.perf_counter()
    return losses, steps


def background_save(engine: Any, save_dir: Path, step: int, max_staged_chunks: int, monitor: Monitor) -> dict:
    """Wait for the previous save, delete its checkpoint (a disk holds one), and start this one in the background."""
    called = time.perf_counter()
    engine.wait_for_checkpoint()
    waited = time.perf_counter()
    if monitor.watched is not None:  # (ended by now, whether or not the monitor's last look saw it)
        monitor.watched.setdefault("done", waited)
    for old in save_dir.glob("global_step*"):
        shutil.rmtree(old)
    deleted = time.perf_counter()
    engine.save_checkpoint(str(save_dir), tag=f"global_step{step}", background=True,
                           max_staged_chunks=max_staged_chunks)
    returned = time.perf_counter()
    save = {"step": step, "tag": f"global_step{step}", "called": deleted, "returned": returned,
            "blocking_s": (waited - called) + (returned - deleted), "delete_s": deleted - waited}
    monitor.watch(save)
    print(f"bench: save at step {step} returned after {returned - deleted:.3f} s (waited {waited - called:.3f} s for "
          "the previous one)", file=sys.stderr, flush=True)
    return save


def child_save(args: argparse.Namespace) -> dict:
    """Run A: train with background saves; the saves' timings and the RSS samples around them."""
    engine, _, config = build(args)
    rss_built = rss_bytes()
    monitor = Monitor(engine)
    saves: list[dict] = []
    losses, steps = train_steps(engine, config, args, 1, args.steps, monitor=monitor, saves=saves)
    started = time.perf_counter()
    engine.wait_for_checkpoint()  # (the last save's end, if it is still writing)
    pending_s = time.perf_counter() - started
    if saves:
        saves[-1].setdefault("done", started + pending_s)
    time.sleep(2 * monitor.interval_s)
    monitor.stop()
    first_save = saves[0]["called"] if saves else steps[-1][1]
    steady = monitor.between(steps[min(2, len(steps) - 1)][0], first_save) or [rss_bytes()]
    for save in saves:
        save["rss_peak"] = max(monitor.between(save["called"], save["done"]) or [rss_bytes()])
    last_checkpoint = Path(args.save_dir) / saves[-1]["tag"] if saves else None
    return {"losses": losses, "steps": steps, "saves": saves, "pending_s": pending_s, "rss_built": rss_built,
            "rss_steady": statistics.median(steady), "rss_after": monitor.samples[-1][1],
            "checkpoint": str(last_checkpoint) if last_checkpoint else None,
            "checkpoint_bytes": directory_bytes(last_checkpoint) if last_checkpoint else 0}


def child_load(args: argparse.Namespace) -> dict:
    """Run C: load the last checkpoint (its files dropped from the page cache) and train the steps after it."""
    engine, _, config = build(args)
    checkpoint = Path(args.load)
    for path in checkpoint.rglob("*"):
        if path.is_file():
            drop_page_cache(path)
    monitor = Monitor()
    rss_before = rss_bytes()
    started = time.perf_counter()
    engine.load_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    load_s = time.perf_counter() - started
    rss_loaded = rss_bytes()
    resumed_at = engine.global_steps
    losses, steps = train_steps(engine, config, args, resumed_at + 1, args.steps, monitor=monitor)
    monitor.stop()
    after = monitor.between(steps[0][1], steps[-1][1]) or [rss_bytes()]
    return {"losses": losses, "resumed_at": resumed_at, "load_s": load_s, "bytes": directory_bytes(checkpoint),
            "rss_before_load": rss_before, "rss_after_load": rss_loaded,
            "rss_steps_after_load": statistics.median(after)}


def child_straight(args: argparse.Namespace) -> dict:
    """Run B: the same steps without saves."""
    engine, _, config = build(args)
    monitor = Monitor()
    losses, _ = train_steps(engine, config, args, 1, args.steps, monitor=monitor)
    monitor.stop()
    return {"losses": losses}


CHILDREN = {"save": child_save, "load": child_load, "straight": child_straight}


def save_lines(run_a: dict, disk: dict, warmup: int) -> list[dict]:
    """One line per save of run A: blocking, write time, bytes and GB/s, the stall, RSS around it."""
    steps, saves = run_a["steps"], run_a["saves"]
    baseline = baseline_step_s(steps, saves, warmup)
    lines = []
    for save in saves:
        stall = save_stall(steps, baseline, called=save["called"], returned=save["returned"], done=save["done"],
                           blocking_s=save["blocking_s"])
        num_bytes = run_a["checkpoint_bytes"]  # (every save of one run writes the same files)
        gbps = num_bytes / stall["write_s"] / 1e9
        lines.append({"measure": "save", "step": save["step"], "blocking_s": save["blocking_s"],
                      "delete_previous_s": save["delete_s"], **stall, "baseline_step_s": baseline, "bytes": num_bytes,
                      "write_gbps": gbps, "fraction_of_disk_write": gbps / disk["write_gbps"],
                      "rss_before_gib": run_a["rss_steady"] / 2**30, "rss_peak_gib": save["rss_peak"] / 2**30,
                      "rss_growth_gib": (save["rss_peak"] - run_a["rss_steady"]) / 2**30})
    return lines


def resume_line(run_a: dict, run_b: dict, run_c: dict) -> dict:
    """Run C against A, beside the spread of A against B over the same steps."""
    first = run_c["resumed_at"]
    a, b, c = run_a["losses"][first:], run_b["losses"][first:], run_c["losses"]
    spread = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    off = max((abs(x - y) for x, y in zip(a, c)), default=0.0)
    verdict = "bit-exact" if c == a else "within noise" if off <= spread else "outside noise"
    return {"measure": "resume", "resumed_at": first, "steps_compared": len(c), "losses_a": a, "losses_b": b,
            "losses_c": c, "spread_ab": spread, "spread_ab_all_steps": max(
                (abs(x - y) for x, y in zip(run_a["losses"], run_b["losses"])), default=0.0),
            "max_diff_ca": off, "verdict": verdict}


def load_line(run_a: dict, run_c: dict, disk: dict) -> dict:
    gbps = run_c["bytes"] / run_c["load_s"] / 1e9
    return {"measure": "load", "load_s": run_c["load_s"], "bytes": run_c["bytes"], "read_gbps": gbps,
            "fraction_of_disk_read": gbps / disk["read_gbps"], "rss_steady_run_gib": run_a["rss_steady"] / 2**30,
            "rss_after_load_gib": run_c["rss_after_load"] / 2**30,
            "rss_steps_after_load_gib": run_c["rss_steps_after_load"] / 2**30,
            "rss_after_load_over_steady_gib": (max(run_c["rss_after_load"], run_c["rss_steps_after_load"])
                                               - run_a["rss_steady"]) / 2**30,
            "rss_before_load_gib": run_c["rss_before_load"] / 2**30,
            "rss_load_growth_gib": (run_c["rss_after_load"] - run_c["rss_before_load"]) / 2**30,
            "rss_built_run_gib": run_a["rss_built"] / 2**30,
            "rss_after_load_over_built_gib": (run_c["rss_after_load"] - run_a["rss_built"]) / 2**30,
            "rss_steps_after_load_over_steady_gib": (run_c["rss_steps_after_load"] - run_a["rss_steady"]) / 2**30}


def summary(saves: list[dict], load: dict, resume: dict, run_a: dict) -> dict:
    """The issue's targets, each against its figure."""
    worst_stall = max((s["stall_fraction"] for s in saves), default=0.0)
    worst_write = min((s["fraction_of_disk_write"] for s in saves), default=0.0)
    worst_rss = max((s["rss_growth_gib"] for s in saves), default=0.0)
    return {"measure": "summary", "saves": len(saves), "stall_fraction_max": worst_stall,
            "stall_ok": worst_stall <= STALL_TARGET, "save_fraction_of_disk_min": worst_write,
            "save_bandwidth_ok": worst_write >= BANDWIDTH_TARGET,
            "load_fraction_of_disk": load["fraction_of_disk_read"],
            "load_bandwidth_ok": load["fraction_of_disk_read"] >= BANDWIDTH_TARGET,
            "rss_save_growth_gib_max": worst_rss, "rss_save_ok": worst_rss <= RSS_TARGET_GIB,
            "rss_after_load_over_steady_gib": load["rss_after_load_over_steady_gib"],
            "rss_load_growth_gib": load["rss_load_growth_gib"],
            "rss_load_ok": max(load["rss_load_growth_gib"], load["rss_after_load_over_built_gib"],
                               load["rss_steps_after_load_over_steady_gib"]) <= RSS_TARGET_GIB,
            "rss_after_saves_gib": run_a["rss_after"] / 2**30, "pending_at_end_s": run_a["pending_s"],
            "resume": resume["verdict"], "resume_max_diff": resume["max_diff_ca"], "spread": resume["spread_ab"]}


def check_free_space(save_dir: Path, model: str, disk_bytes: int) -> int:
    """The checkpoint's estimated bytes; exits with a message when the disk cannot hold one (and the disk test)."""
    import torch

    with torch.device("meta"):
        num_params = sum(p.numel() for p in user_models.build("nngpt", model).parameters())
    need = CHECKPOINT_BYTES_PER_PARAM * num_params
    save_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(save_dir).free + directory_bytes(save_dir)  # (what this bench left there is deleted)
    if free < 1.05 * max(need, disk_bytes):
        sys.exit(f"bench: {save_dir} has {free / 1e9:.1f} GB free; a {model} checkpoint needs about "
                 f"{need / 1e9:.1f} GB ({num_params / 1e9:.2f} B parameters x {CHECKPOINT_BYTES_PER_PARAM} B: fp32 "
                 f"master and Adam moments, bf16 weights) and the disk test {disk_bytes / 1e9:.1f} GB. Free space, "
                 "pass --save-dir on a larger disk, or a smaller --model (1.3b)")
    return need


def run_child(role: str, args: argparse.Namespace, extra: list[str] | None = None) -> dict:
    """One run in its own process (bench/user_workloads.py's runner): its RESULT line."""
    command = [sys.executable, __file__, "--child", role, "--model", args.model, "--steps", str(args.steps),
               "--save-every", str(args.save_every), "--save-dir", args.save_dir, "--config", args.config,
               "--max-staged-chunks", str(args.max_staged_chunks), *(extra or [])]
    command += ["--memory-cap", args.memory_cap] if args.memory_cap else []
    command += [arg for edit in args.edits for arg in ("--set", edit)]
    started = time.perf_counter()
    returncode, results, tail = user_workloads.run_child(command)
    if returncode or not results:
        sys.exit(f"bench: run {role} failed (exit {returncode}):\n" + "\n".join(tail))
    print(f"bench: run {role} took {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads(results[-1].removeprefix("RESULT "))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fits_the_host = [size for size, (_, hidden, _) in user_models.SHAPES.items() if hidden < 5120]  # (the 13B-up: no)
    parser.add_argument("--model", default="2.7b", choices=fits_the_host,
                        help="size of the torch.nn GPT (default 2.7b; 1.3b where the disk holds less)")
    parser.add_argument("--quick", action="store_true", help="the tiny model on CPU, small steps and disk test")
    parser.add_argument("--steps", type=int, help="steps of runs A and B (default 30; --quick 5)")
    parser.add_argument("--save-every", type=int, help="run A saves every this many steps (default 10; --quick 2)")
    parser.add_argument("--save-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "angelptm_save_bench"),
                        help="where the disk test and the checkpoints go (emptied first)")
    parser.add_argument("--disk-gb", type=float, help="bytes of the disk test, in GB (default 4; --quick 0.03)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the DeepSpeed JSON (default ZeRO-Infinity)")
    parser.add_argument("--memory-cap", help="GPU bytes this process may use (default 22GB on a GPU, the capped row)")
    parser.add_argument("--max-staged-chunks", type=int, help="save_checkpoint's staging (default the engine's)")
    parser.add_argument("--set", dest="edits", action="append", default=[],
                        help="dotted.key=JSON_VALUE edit of the config, after the bench's own (repeatable)")
    parser.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.model = "tiny"
    quick = args.model == "tiny"
    args.steps = args.steps or (5 if quick else 30)
    args.save_every = args.save_every or (2 if quick else 10)
    args.disk_gb = args.disk_gb if args.disk_gb is not None else (0.03 if quick else 4.0)
    if args.max_staged_chunks is None:
        from angelptm.checkpoints.engine_save import STAGED_CHUNKS

        args.max_staged_chunks = STAGED_CHUNKS
    if args.memory_cap is None and not quick:
        args.memory_cap = "22GB"
    for name in ("steps", "save_every", "max_staged_chunks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.save_every >= args.steps:
        parser.error(f"--save-every {args.save_every} must be below --steps {args.steps}: run C resumes from a save")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
        result = CHILDREN[args.child](args)
        print("RESULT " + json.dumps(result), flush=True)
        sys.stderr.flush()
        os._exit(0)  # skip the interpreter's teardown (threads); every save was waited for
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29512")):
        os.environ.setdefault(key, value)
    save_dir = Path(args.save_dir)
    if save_dir.exists():
        shutil.rmtree(save_dir)
    disk_bytes = int(args.disk_gb * 1e9)
    check_free_space(save_dir, args.model, disk_bytes)
    disk = disk_bandwidth(save_dir, disk_bytes)
    print(json.dumps(disk), flush=True)
    run_a = run_child("save", args)
    saves = save_lines(run_a, disk, warmup=min(2, args.save_every - 1))
    for line in saves:
        print(json.dumps(line), flush=True)
    run_c = run_child("load", args, ["--load", run_a["checkpoint"]])
    load = load_line(run_a, run_c, disk)
    print(json.dumps(load), flush=True)
    shutil.rmtree(save_dir)  # (run B saves nothing)
    run_b = run_child("straight", args)
    resume = resume_line(run_a, run_b, run_c)
    print(json.dumps(resume), flush=True)
    print(json.dumps({**summary(saves, load, resume, run_a), "model": args.model, "steps": args.steps,
                      "save_every": args.save_every, "max_staged_chunks": args.max_staged_chunks,
                      "config": Path(args.config).stem, "memory_cap": args.memory_cap,
                      "edits": DEFAULT_EDITS + args.edits}), flush=True)


if __name__ == "__main__":
    main()
