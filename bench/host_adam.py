"""Host Adam throughput on one ZeRO-Cache chunk: the library kernels against csrc/fused_host_adam.cpp.

    python bench/host_adam.py --numel 320000000 --repeats 5

Each backend does what ZeRO-Cache's host update needs per chunk: take the bf16 gradient (as it
arrives from the GPU), step the fp32 master / exp_avg / exp_avg_sq, and leave the new weights in
bf16 for the copy back. The library paths need two extra passes (bf16 -> fp32 gradient, fp32 ->
bf16 weights); the native kernel does it in one. Ratios are against DeepSpeed's cpu_adam path in
the same run (torch's fused CPU Adam when DeepSpeed's op does not build).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zero_cache.optim.host_adam import HostAdam  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=320_000_000, help="elements in the chunk")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.numel
    master, exp_avg, exp_avg_sq = torch.randn(n), torch.zeros(n), torch.zeros(n)
    grad_bf16 = (torch.randn(n) * 1e-3).bfloat16()
    scratch, weights = torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
    library = HostAdam(True, try_deepspeed=True)
    torch_only = HostAdam(True, try_deepspeed=False)
    native = HostAdam(True, try_deepspeed=False, try_native=True)

    def library_path(adam: HostAdam):
        def run(step: int) -> None:
            scratch.copy_(grad_bf16)
            adam.update([master], [scratch], [exp_avg], [exp_avg_sq], step=step, **HYPER)
            weights.copy_(master)
        return run

    def native_path(step: int) -> None:
        weights.copy_(grad_bf16)  # the staging buffer arrives holding the gradient
        native.update_in_place(master, weights, exp_avg, exp_avg_sq, step=step, grad_scale=1.0, **HYPER)

    runs = {}
    if library.name.startswith("deepspeed"):
        runs["deepspeed cpu_adam + 2 conversions"] = library_path(library)
    runs["torch fused CPU Adam + 2 conversions"] = library_path(torch_only)
    if native.fuses(torch.bfloat16):
        runs["csrc fused_host_adam (one pass)"] = native_path
    results = {}
    for name, run in runs.items():
        times = []
        for step in range(1, args.repeats + 2):
            start = time.perf_counter()
            run(step)
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times[1:])  # the first touches cold pages
    anchor = next(iter(results.values()))
    print(f"chunk of {n:,} elements, {torch.get_num_threads()} threads\n")
    print("| backend | ms per chunk | G params/s | vs first row |\n|---|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds * 1e3:.0f} | {n / seconds / 1e9:.2f} | {anchor / seconds:.2f}x |")


if __name__ == "__main__":
    main()
