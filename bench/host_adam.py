"""The host's Adam against the host's memory bound and against DeepSpeed's ``cpu_adam``, on the same tensors.

    python bench/host_adam.py --numel 300000000 --repeats 5

One chunk of ``--numel`` elements, as ZeRO-Cache's host update sees it: fp32 master, exp_avg and exp_avg_sq, and a
bf16 gradient that arrives from the GPU and leaves as the bf16 weight sent back. Measured with the engine's thread
count (every core but the training thread's, :class:`zero_cache.optim.host_adam.HostAdam`), in one process:

1. **The host's memory bandwidth**, a STREAM-style triad ``a = b + s * c`` over fp32 arrays of the chunk's size,
   counted as STREAM counts it (12 bytes an element: two read, one written), and an in-place pass over the same
   arrays (read and written back, 8 bytes an element: the Adam's own access pattern, no write-allocate).
2. **The Adam's memory bound**: that bandwidth over the bytes an element of the host's Adam moves
   (:func:`zero_cache.plan.step_cost.host_adam_bytes_per_element`: 28 with a bf16 gradient), in G elements/s; the
   csrc kernel's rate as a fraction of it.
3. **The backends on the same tensors**: ``csrc/fused_host_adam.cpp`` (one pass: bf16 gradient in, bf16 weight
   out), with the gradient's landing in its buffer (a host copy here, the device's copy in a step) and alone;
   DeepSpeed's ``cpu_adam`` with the two conversions the engine would need around it (bf16 -> fp32 gradient,
   fp32 -> bf16 weight), and its kernel alone on an fp32 gradient (what it is built for); torch's fused CPU Adam with
   the conversions.

Prints a table and one JSON line. GB are 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zero_cache.optim.host_adam import HostAdam  # noqa: E402
from zero_cache.plan.step_cost import host_adam_bytes_per_element  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TRIAD_BYTES = 12
"""STREAM's count for ``a = b + s * c`` in fp32: b and c read, a written (the write-allocate read is not counted)."""
IN_PLACE_BYTES = 8
"""An fp32 array read and written back in place."""


def bandwidth_gbs(numel: int, bytes_per_element: int, seconds: float) -> float:
    """GB/s of a pass over ``numel`` elements that moves ``bytes_per_element`` each."""
    return numel * bytes_per_element / seconds / 1e9


def adam_bound(bandwidth: float, bytes_per_element: int) -> float:
    """The host Adam's rate bound in G elements/s: ``bandwidth`` (GB/s) over the bytes each element moves."""
    return bandwidth / bytes_per_element


def median_seconds(run: Callable[[int], None], repeats: int) -> float:
    """Median seconds of ``run(step)`` over ``repeats`` calls after a first, untimed one (first page touches)."""
    run(1)
    times = []
    for step in range(2, repeats + 2):
        start = time.perf_counter()
        run(step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_passes(numel: int, repeats: int) -> dict[str, float]:
    """GB/s of the triad (STREAM's count) and of an in-place pass, over fp32 arrays of ``numel`` elements."""
    a, b, c = torch.empty(numel), torch.rand(numel), torch.rand(numel)
    triad = median_seconds(lambda _: torch.add(b, c, alpha=3.0, out=a), repeats)
    in_place = median_seconds(lambda _: b.mul_(1.0000001), repeats)
    return {"triad_gbs": bandwidth_gbs(numel, TRIAD_BYTES, triad),
            "in_place_gbs": bandwidth_gbs(numel, IN_PLACE_BYTES, in_place)}


def backends(numel: int) -> dict[str, Callable[[int], None]]:
    """name -> one step of that backend over the same chunk's tensors (each step rewrites the gradient first, as it
    lands from the device)."""
    master, exp_avg, exp_avg_sq = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    grad = (torch.randn(numel) * 1e-3).bfloat16()
    staging, grad_fp32 = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel)
    runs: dict[str, Callable[[int], None]] = {}
    native = HostAdam(True, try_deepspeed=False, try_native=True)
    if native.fuses(torch.bfloat16):
        def csrc(step: int) -> None:
            staging.copy_(grad)
            native.update_in_place(master, staging, exp_avg, exp_avg_sq, step=step, grad_scale=1.0, **HYPER)
        runs["csrc fused_host_adam (one pass)"] = csrc

        def csrc_alone(step: int) -> None:  # (the buffer holds the last step's weights: a gradient as good as any)
            native.update_in_place(master, staging, exp_avg, exp_avg_sq, step=step, grad_scale=1e-3, **HYPER)
        runs["csrc fused_host_adam, kernel alone (gradient in place)"] = csrc_alone
    for name, adam in (("deepspeed cpu_adam", HostAdam(True, try_deepspeed=True)),
                       ("torch fused CPU Adam", HostAdam(True, try_deepspeed=False))):
        if name.startswith("deepspeed") and not adam.name.startswith("deepspeed"):
            continue  # (it did not build here; the log says why)

        def converted(step: int, adam: HostAdam = adam) -> None:
            staging.copy_(grad)
            grad_fp32.copy_(staging)
            adam.update([master], [grad_fp32], [exp_avg], [exp_avg_sq], step=step, **HYPER)
            staging.copy_(master)
        runs[f"{name} + 2 conversions"] = converted
        if name.startswith("deepspeed"):
            grad_fp32.copy_(grad)

            def alone(step: int, adam: HostAdam = adam) -> None:
                adam.update([master], [grad_fp32], [exp_avg], [exp_avg_sq], step=step, **HYPER)
            runs[f"{name}, kernel alone (fp32 gradient)"] = alone
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=300_000_000, help="elements in the chunk")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    threads = HostAdam(True, try_deepspeed=False).threads
    torch.set_num_threads(threads)  # (the triad's, and the library kernels' OpenMP threads: the engine's count)
    result: dict[str, object] = {"numel": args.numel, "threads": threads, **memory_passes(args.numel, args.repeats)}
    element_bytes = host_adam_bytes_per_element(2)
    bound = adam_bound(result["triad_gbs"], element_bytes)
    result["adam_bound_g_per_s"] = bound
    rates = {name: args.numel / median_seconds(run, args.repeats) / 1e9 for name, run in backends(args.numel).items()}
    result["rates_g_per_s"] = rates
    ds = rates.get("deepspeed cpu_adam, kernel alone (fp32 gradient)")
    print(f"chunk of {args.numel:,} elements, {threads} threads; triad {result['triad_gbs']:.1f} GB/s (STREAM's "
          f"count), in place {result['in_place_gbs']:.1f} GB/s; the Adam's bound at {element_bytes} B an element: "
          f"{bound:.2f} G elements/s\n")
    print("| backend | G elements/s | GB/s at 28 B | of the triad's bound | vs DeepSpeed cpu_adam alone |")
    print("|---|---|---|---|---|")
    for name, rate in rates.items():
        versus = f"{rate / ds:.2f}x" if ds else "n/a"
        print(f"| {name} | {rate:.2f} | {rate * element_bytes:.1f} | {rate / bound:.0%} | {versus} |")
    print(json.dumps({k: ({n: round(r, 3) for n, r in v.items()} if isinstance(v, dict) else
                          round(v, 3) if isinstance(v, float) else v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
