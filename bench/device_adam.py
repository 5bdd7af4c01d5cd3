"""The device's Adam over device-held chunks: four passes (the gradient made fp32 in a scratch, scaled, torch's fused
Adam, the params rewritten from the masters) against one (``zero_cache.optim.device_adam``), on the GPU.

    python bench/device_adam.py --elements 2.78e9 --chunk 154e6

Times both over ``--elements`` elements in chunks of ``--chunk`` (the 2.78B GPT's 18 chunks by default, cut to what
fits: the figure is per element), and plain torch's bf16 AdamW without masters over the same count, the anchor of the
``h100_2p7b_whole`` row. Prints one JSON line: ms per step for each, each Adam's time against plain torch's in the
same run, and the bytes per element each moves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zero_cache.optim.chunk_adam import state_gradient  # noqa: E402
from zero_cache.optim.device_adam import adam_in_one_pass  # noqa: E402
from zero_cache.optim.host_adam import torch_fused_adam  # noqa: E402

HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def timed(step, repeats: int) -> float:
    """Seconds per call of ``step()``, the median of ``repeats`` after a warm-up call."""
    step()
    times: list[float] = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=float, default=2.78e9, help="the model's elements (scaled to them)")
    parser.add_argument("--chunk", type=float, default=154e6, help="elements per chunk")
    parser.add_argument("--chunks", type=int, default=4, help="chunks timed (the figure is scaled per element)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the one pass at other elements per program and warps per program")
    args = parser.parse_args()
    device = torch.device("cuda")
    numel, count = int(args.chunk), args.chunks
    chunks = [{"states": [torch.randn(numel, device=device) for _ in range(3)],
               "params": torch.randn(numel, device=device).to(torch.bfloat16)} for _ in range(count)]
    for chunk in chunks:
        chunk["states"][2].abs_()
    scratch = torch.empty(numel, device=device)

    def four_passes() -> None:
        for chunk in chunks:
            master, exp_avg, exp_avg_sq = chunk["states"]
            grads = state_gradient(chunk["params"], scratch, 0.5)
            torch_fused_adam([master], [grads], [exp_avg], [exp_avg_sq], decoupled=True, step=10, **HYPER)
            chunk["params"].copy_(master)

    def one_pass() -> None:
        for chunk in chunks:
            adam_in_one_pass(chunk["states"], chunk["params"], chunk["params"], grad_factor=0.5, step=10,
                             decoupled=True, **HYPER)

    bf16 = [torch.randn(numel, device=device).to(torch.bfloat16).requires_grad_() for _ in range(count)]
    for param in bf16:
        param.grad = torch.randn_like(param)
    plain = torch.optim.AdamW(bf16, fused=True, **HYPER)
    scale = args.elements / (numel * count)
    figures = {name: timed(step, args.repeats) * scale * 1e3
               for name, step in (("four_passes_ms", four_passes), ("one_pass_ms", one_pass),
                                  ("plain_torch_bf16_ms", plain.step))}
    anchor = figures["plain_torch_bf16_ms"]
    if args.sweep:  # (BLOCK x num_warps: the kernel is bound by memory, so the best should read near the HBM's rate)
        variants = [{}, {"numel_known": True}, {"even_blocks": True}]  # (vectorized loads: by hint, or no mask)
        for variant in variants:
            for block in (1024, 2048, 4096, 8192):
                for warps in (4, 8, 16):
                    def swept(block: int = block, warps: int = warps, variant: dict = variant) -> None:
                        for chunk in chunks:
                            adam_in_one_pass(chunk["states"], chunk["params"], chunk["params"], grad_factor=0.5,
                                             step=10, decoupled=True, block=block, num_warps=warps, **variant,
                                             **HYPER)
                    name = f"one_pass_block{block}_warps{warps}" + "".join(f"_{key}" for key in variant)
                    try:
                        ms = timed(swept, args.repeats) * scale * 1e3
                    except Exception as err:  # (a variant that does not compile here is reported, not fatal)
                        print(f"{name}: failed: {type(err).__name__}: {err}", flush=True)
                        continue
                    figures[f"{name}_ms"] = ms
                    print(f"{name}: {ms:.2f} ms, {28 * args.elements / ms / 1e6:.0f} GB/s", flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "elements": args.elements, **figures,
                      "vs_plain_torch": {"four_passes": figures["four_passes_ms"] / anchor,
                                         "one_pass": figures["one_pass_ms"] / anchor},
                      "bytes_per_element": {"four_passes": 48, "one_pass": 28, "plain_torch_bf16": 14}}))


if __name__ == "__main__":
    main()
