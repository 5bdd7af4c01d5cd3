"""Measure intra-node all-to-all bandwidth and latency, then predict flat vs hierarchical all-to-all
for N nodes x 8 GPUs with the alpha-beta model in ``moe.topology``.

    torchrun --nproc-per-node 2 bench/moe_alltoall.py --log-file runs/moe_alltoall.log   # measure on 2 GPUs
    python bench/moe_alltoall.py --intra-gbs 350 --intra-latency-us 5 --log-file t.log   # table from given figures

The inter-node link cannot be measured on one host: it is a parameter (default: one 400 Gb/s
InfiniBand NIC per GPU = 50 GB/s, 15 us per message, the usual H100/H200 SuperPOD layout).

Fit: on one node of L ranks a flat all-to-all of B bytes per rank takes
t = (L - 1) * alpha + B (L - 1) / L / bw, so alpha and bw come from a least-squares line through
(B (L - 1) / L, t) over message sizes from 64 KiB to 256 MiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.topology import Link, crossover_bytes, flat_all_to_all_s, hierarchical_all_to_all_s  # noqa: E402

SIZES_BYTES = [2 ** p for p in range(16, 29, 2)]  # 64 KiB .. 256 MiB per rank
TABLE_BYTES = [256 * 2 ** 10, 2 * 2 ** 20, 16 * 2 ** 20, 128 * 2 ** 20]
NODES = [1, 2, 4, 8, 16, 32, 64]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-file", required=True)
    parser.add_argument("--intra-gbs", type=float, help="skip the measurement: intra-node GB/s per GPU")
    parser.add_argument("--intra-latency-us", type=float, default=5.0, help="with --intra-gbs")
    parser.add_argument("--inter-gbps", type=float, default=400.0, help="inter-node Gb/s per GPU (bits)")
    parser.add_argument("--inter-latency-us", type=float, default=15.0)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    return parser.parse_args()


def measure_intra(iters: int) -> tuple[Link, list[str]]:
    """All-to-all times between the ranks of this host; returns the fitted link and the raw lines."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    points, lines = [], []
    for size in SIZES_BYTES:
        send = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
        recv = torch.empty_like(send)
        times = []
        for i in range(iters + 3):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_to_all_single(recv, send)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - start)
        seconds = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        moved = size * (world - 1) / world
        points.append((moved, seconds.item()))
        lines.append(f"  {size / 2 ** 20:9.3f} MiB per rank: {seconds.item() * 1e6:9.1f} us, "
                     f"{moved / seconds.item() / 1e9:7.1f} GB/s per GPU off-rank")
    xs = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ys = torch.tensor([p[1] for p in points], dtype=torch.float64)
    slope, intercept = torch.linalg.lstsq(torch.stack([xs, torch.ones_like(xs)], 1), ys.unsqueeze(1)).solution.flatten().tolist()
    link = Link(max(intercept, 0.0) / max(world - 1, 1), 1.0 / slope)
    lines.append(f"  fit: alpha {link.latency_s * 1e6:.2f} us per message, bandwidth {link.bandwidth_bytes_per_s / 1e9:.1f} "
                 f"GB/s per GPU ({world} ranks, {'NCCL' if device.type == 'cuda' else 'gloo'})")
    is_main = rank == 0
    dist.destroy_process_group()
    return (link, lines) if is_main else (link, [])


def table(intra: Link, inter: Link, gpus_per_node: int) -> list[str]:
    head = f"| nodes x GPUs | {' | '.join(f'{b / 2 ** 20:g} MiB: flat / hier (ms)' for b in TABLE_BYTES)} | crossover |"
    lines = [head, "|" + "---|" * (len(TABLE_BYTES) + 2)]
    for nodes in NODES:
        cells = []
        for size in TABLE_BYTES:
            flat = flat_all_to_all_s(size, gpus_per_node, nodes, intra, inter) * 1e3
            hier = hierarchical_all_to_all_s(size, gpus_per_node, nodes, intra, inter) * 1e3
            cells.append(f"{flat:.3f} / {hier:.3f}{' **H**' if hier < flat else ''}")
        cross = crossover_bytes(gpus_per_node, nodes, intra, inter)
        lines.append(f"| {nodes} x {gpus_per_node} | {' | '.join(cells)} | "
                     f"{'never' if cross is None else f'{cross / 2 ** 20:.2f} MiB'} |")
    return lines


def main() -> None:
    args = parse_args()
    inter = Link(args.inter_latency_us * 1e-6, args.inter_gbps / 8 * 1e9)
    if args.intra_gbs is not None:
        intra, lines = Link(args.intra_latency_us * 1e-6, args.intra_gbs * 1e9), ["intra-node link given, not measured"]
    else:
        intra, lines = measure_intra(args.iters)
        if not lines:
            return
    lines.append(f"intra: {intra.latency_s * 1e6:.2f} us, {intra.bandwidth_bytes_per_s / 1e9:.1f} GB/s per GPU | "
                 f"inter (assumed): {inter.latency_s * 1e6:.2f} us, {inter.bandwidth_bytes_per_s / 1e9:.1f} GB/s per GPU "
                 f"({args.inter_gbps:g} Gb/s) | bytes = what each GPU sends per all-to-all; **H** = hierarchical faster")
    lines += table(intra, inter, args.gpus_per_node)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
    Path(args.log_file).write_text(text)


if __name__ == "__main__":
    main()
