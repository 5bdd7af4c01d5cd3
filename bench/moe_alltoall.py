"""Measure intra-node all-to-all bandwidth and latency, then predict flat vs hierarchical all-to-all
for N nodes x 8 GPUs with the alpha-beta model in ``moe.topology``; or, with ``--ranks-per-node``,
time the MoE package's real flat and hierarchical exchanges on W ranks treated as W / L nodes.

    torchrun --nproc-per-node 2 bench/moe_alltoall.py --log-file runs/moe_alltoall.log   # measure on 2 GPUs
    python bench/moe_alltoall.py --intra-gbs 350 --intra-latency-us 5 --log-file t.log   # table from given figures
    torchrun --nproc-per-node 4 bench/moe_alltoall.py --ranks-per-node 2 --log-file runs/moe_alltoall_2x2.log
    torchrun --nproc-per-node 4 bench/moe_alltoall.py --ranks-per-node 2 --max-mib 0.25 --iters 2 \
        --log-file /tmp/moe_alltoall_2x2.log                                              # CPU check (gloo)

The inter-node link cannot be measured on one host: it is a parameter (default: one 400 Gb/s
InfiniBand NIC per GPU = 50 GB/s, 15 us per message, the usual H100/H200 SuperPOD layout).

Fit: on one node of L ranks a flat all-to-all of B bytes per rank takes
t = (L - 1) * alpha + B (L - 1) / L / bw, so alpha and bw come from a least-squares line through
(B (L - 1) / L, t) over message sizes from 64 KiB to 256 MiB.

Exchange mode (``--ranks-per-node L``, W ranks as M = W / L nodes): the fit runs on each node's L
ranks (the intra-node group); then, per message size, the same seeded token counts (every rank sends
B bytes, unevenly over E = W x experts-per-rank experts) go through ``moe.alltoall``'s ``flat_plan``
and ``hierarchical_plan`` executed by ``Exchange`` (forward only, the layer's own ops: all-to-alls and
the reorders around them; plans are built outside the timing). Each rank checks that both deliver
identical rows. Printed per size: measured flat and hierarchical ms (median over iterations, slowest
rank), and ``moe.topology``'s predictions with the fitted intra link and (a) the assumed inter link,
what M real nodes would see, (b) inter = the fitted intra link, what this one host actually has.
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

from moe.alltoall import Exchange, ExchangePlan, flat_plan, hierarchical_plan  # noqa: E402
from moe.topology import (ExpertParallelGroups, Link, build_expert_parallel_groups, crossover_bytes,  # noqa: E402
                          flat_all_to_all_s, hierarchical_all_to_all_s)

SIZES_BYTES = [2 ** p for p in range(16, 29, 2)]  # 64 KiB .. 256 MiB per rank
TABLE_BYTES = [256 * 2 ** 10, 2 * 2 ** 20, 16 * 2 ** 20, 128 * 2 ** 20]
NODES = [1, 2, 4, 8, 16, 32, 64]
WARMUP_ITERS = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-file", required=True)
    parser.add_argument("--intra-gbs", type=float, help="skip the measurement: intra-node GB/s per GPU")
    parser.add_argument("--intra-latency-us", type=float, default=5.0, help="with --intra-gbs")
    parser.add_argument("--inter-gbps", type=float, default=400.0, help="inter-node Gb/s per GPU (bits)")
    parser.add_argument("--inter-latency-us", type=float, default=15.0)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ranks-per-node", type=int,
                        help="exchange mode: treat the W ranks as W / L nodes of L and time flat against "
                             "hierarchical exchanges of the moe package")
    parser.add_argument("--max-mib", type=float, default=256.0,
                        help="largest message per rank, MiB (fit and exchanges)")
    parser.add_argument("--experts-per-rank", type=int, default=2, help="exchange mode: J, experts on each rank")
    parser.add_argument("--hidden", type=int, default=2048, help="exchange mode: D, elements per row (bf16)")
    parser.add_argument("--seed", type=int, default=0, help="exchange mode: seed of the token counts")
    args = parser.parse_args()
    if args.ranks_per_node is not None and args.intra_gbs is not None:
        parser.error("--ranks-per-node measures the intra-node link; drop --intra-gbs")
    return args


def init_device() -> torch.device:
    """Start the process group (NCCL on GPUs, gloo on CPU) and return this rank's device."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest_s(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (an exchange is done when its slowest rank is)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def sizes_bytes(max_mib: float) -> list[int]:
    """The message sizes per rank up to ``max_mib``."""
    sizes = [size for size in SIZES_BYTES if size <= max_mib * 2 ** 20]
    if len(sizes) < 2:
        raise SystemExit(f"--max-mib {max_mib}: at least 2 sizes from 64 KiB up are needed for the fit")
    return sizes


def measure_link(device: torch.device, iters: int, sizes: list[int],
                 group: dist.ProcessGroup | None = None) -> tuple[Link, list[str]]:
    """Time all_to_all_single over ``group`` (default: all ranks) per size and fit an alpha-beta link.

    Returns:
        The fitted link and the raw lines (the same on every rank).
    """
    ranks = dist.get_world_size(group)
    points, lines = [], []
    for size in sizes:
        send = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
        recv = torch.empty_like(send)
        times_s = []
        for i in range(iters + WARMUP_ITERS):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            synchronize(device)
            if i >= WARMUP_ITERS:
                times_s.append(time.perf_counter() - start)
        seconds = slowest_s(statistics.median(times_s), device)
        moved_bytes = size * (ranks - 1) / ranks
        points.append((moved_bytes, seconds))
        lines.append(f"  {size / 2 ** 20:9.3f} MiB per rank: {seconds * 1e6:9.1f} us, "
                     f"{moved_bytes / seconds / 1e9:7.1f} GB/s per GPU off-rank")
    xs = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ys = torch.tensor([p[1] for p in points], dtype=torch.float64)
    slope, intercept = torch.linalg.lstsq(torch.stack([xs, torch.ones_like(xs)], 1), ys.unsqueeze(1)).solution.flatten().tolist()
    # A noisy fit (e.g. gloo on a loaded CPU) can give a slope <= 0: floor it so Link stays valid.
    link = Link(max(intercept, 0.0) / max(ranks - 1, 1), 1.0 / max(slope, 1e-15))
    lines.append(f"  fit: alpha {link.latency_s * 1e6:.2f} us per message, bandwidth {link.bandwidth_bytes_per_s / 1e9:.1f} "
                 f"GB/s per GPU ({ranks} ranks, {'NCCL' if device.type == 'cuda' else 'gloo'})")
    return link, lines


def measure_intra(iters: int, max_mib: float = 256.0) -> tuple[Link, list[str]]:
    """All-to-all times between the ranks of this host; returns the fitted link and (rank 0) the raw lines."""
    device = init_device()
    link, lines = measure_link(device, iters, sizes_bytes(max_mib))
    is_main = dist.get_rank() == 0
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


def link_line(intra: Link, inter: Link, inter_gbps: float) -> str:
    return (f"intra: {intra.latency_s * 1e6:.2f} us, {intra.bandwidth_bytes_per_s / 1e9:.1f} GB/s per GPU | "
            f"inter (assumed): {inter.latency_s * 1e6:.2f} us, {inter.bandwidth_bytes_per_s / 1e9:.1f} GB/s per GPU "
            f"({inter_gbps:g} Gb/s) | bytes = what each GPU sends per all-to-all; **H** = hierarchical faster")


# ---- exchange mode: the moe package's flat and hierarchical exchanges ----

def token_counts(size_bytes: int, row_bytes: int, world: int, experts: int, seed: int) -> list[list[int]]:
    """counts_WE: rows each rank sends to each expert, about ``size_bytes`` per rank, uneven
    (weights uniform in [0.5, 1.5)); seeded, so every rank computes the same matrix."""
    rows = max(size_bytes // row_bytes, 1)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + size_bytes)
    weights_WE = 0.5 + torch.rand(world, experts, generator=generator, dtype=torch.float64)
    return (weights_WE / weights_WE.sum(1, keepdim=True) * rows).floor().long().tolist()


def time_exchange(plan: ExchangePlan, rows_ND: torch.Tensor, iters: int,
                  device: torch.device) -> tuple[float, torch.Tensor]:
    """Median seconds of one exchange on this rank, and the rows it delivered."""
    times_s = []
    for i in range(iters + WARMUP_ITERS):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        received_ND = Exchange(plan.ops, rows_ND).finish()
        synchronize(device)
        if i >= WARMUP_ITERS:
            times_s.append(time.perf_counter() - start)
    return statistics.median(times_s), received_ND


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def exchange_one_size(args, groups: ExpertParallelGroups, size_bytes: int, device: torch.device) -> dict:
    """Route the same counts through the flat and the hierarchical plan; time both, compare rows."""
    row_bytes = args.hidden * 2  # bf16
    counts_WE = token_counts(size_bytes, row_bytes, groups.size, groups.size * args.experts_per_rank, args.seed)
    generator = torch.Generator().manual_seed(args.seed + 7919 * (groups.rank + 1))
    rows_ND = torch.randn(sum(counts_WE[groups.rank]), args.hidden, generator=generator).to(device, torch.bfloat16)
    flat = flat_plan(counts_WE, groups.rank, groups.group)
    hier = hierarchical_plan(counts_WE, groups.rank, groups.ranks_per_node, groups.intra, groups.inter)
    with torch.no_grad():
        flat_s, flat_ND = time_exchange(flat, rows_ND, args.iters, device)
        hier_s, hier_ND = time_exchange(hier, rows_ND, args.iters, device)
    sent_bytes = max(sum(row) for row in counts_WE) * row_bytes  # the busiest sender sets the pace
    return {"bytes": sent_bytes, "flat_s": slowest_s(flat_s, device), "hier_s": slowest_s(hier_s, device),
            "identical": all_ranks_true(torch.equal(flat_ND, hier_ND), device), "rows": flat_ND.shape[0]}


def exchange_lines(results: list[dict], groups: ExpertParallelGroups, intra: Link, inter: Link) -> list[str]:
    """Per size: measured flat / hierarchical ms and the cost model's predictions."""
    lpn, nodes = groups.ranks_per_node, groups.nodes
    lines = ["| bytes per rank | flat ms | hier ms | hier / flat | predicted flat / hier ms (assumed inter) "
             "| predicted flat / hier ms (inter = fitted intra) | identical rows |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        model = [(f(r["bytes"], lpn, nodes, intra, link) * 1e3) for link in (inter, intra)
                 for f in (flat_all_to_all_s, hierarchical_all_to_all_s)]
        lines.append(f"| {r['bytes'] / 2 ** 20:.3f} MiB | {r['flat_s'] * 1e3:.3f} | {r['hier_s'] * 1e3:.3f} | "
                     f"{r['hier_s'] / r['flat_s']:.2f} | {model[0]:.3f} / {model[1]:.3f} | "
                     f"{model[2]:.3f} / {model[3]:.3f} | {r['identical']} |")
    same = all(r["identical"] for r in results)
    lines.append(f"identical received rows (flat vs hierarchical, every rank, every size): {same}")
    return lines


def run_exchanges(args, inter: Link) -> list[str]:
    """Exchange mode: fit the intra-node link, then time flat against hierarchical per size (rank 0 gets the lines)."""
    device = init_device()
    world = dist.get_world_size()
    if args.ranks_per_node < 2 or world % args.ranks_per_node or world // args.ranks_per_node < 2:
        raise SystemExit(f"--ranks-per-node {args.ranks_per_node}: needs >= 2 nodes of >= 2 ranks on {world} ranks")
    groups = build_expert_parallel_groups(world, args.ranks_per_node)
    sizes = sizes_bytes(args.max_mib)
    intra, fit_lines = measure_link(device, args.iters, sizes, groups.intra)
    results = [exchange_one_size(args, groups, size, device) for size in sizes]
    lines = [f"MoE exchange, {world} ranks as {groups.nodes} nodes x {groups.ranks_per_node} | "
             f"{'NCCL ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else 'gloo cpu'} | "
             f"{groups.size * args.experts_per_rank} experts, rows of {args.hidden} bf16, {args.iters} iterations",
             f"flat all-to-all inside each node ({groups.ranks_per_node} ranks), the intra-node fit:", *fit_lines,
             link_line(intra, inter, args.inter_gbps),
             "bytes per rank = rows the busiest rank sends; ms = median of the slowest rank; forward only",
             *exchange_lines(results, groups, intra, inter),
             f"cost model for N nodes x {args.gpus_per_node} with the fitted intra link:",
             *table(intra, inter, args.gpus_per_node)]
    is_main = dist.get_rank() == 0
    dist.destroy_process_group()
    return lines if is_main else []


def write(lines: list[str], log_file: str) -> None:
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    Path(log_file).write_text(text)


def main() -> None:
    args = parse_args()
    inter = Link(args.inter_latency_us * 1e-6, args.inter_gbps / 8 * 1e9)
    if args.ranks_per_node is not None:
        lines = run_exchanges(args, inter)
        if lines:
            write(lines, args.log_file)
        return
    if args.intra_gbs is not None:
        intra, lines = Link(args.intra_latency_us * 1e-6, args.intra_gbs * 1e9), ["intra-node link given, not measured"]
    else:
        intra, lines = measure_intra(args.iters, args.max_mib)
        if not lines:
            return
    lines.append(link_line(intra, inter, args.inter_gbps))
    lines += table(intra, inter, args.gpus_per_node)
    write(lines, args.log_file)


if __name__ == "__main__":
    main()
