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
t = (L - 1) * alpha + B (L - 1) / L / bw, so alpha and bw come from a line through (B (L - 1) / L, t) over
message sizes from 64 KiB to 256 MiB, least squares in relative error (``moe.topology.fit_link``; absolute least
squares let the 256 MiB point set the intercept: issue 41).

Exchange mode (``--ranks-per-node L``, W ranks as M = W / L nodes): the fit runs on each node's L
ranks (the intra-node group); then, per message size, the same seeded token counts (every rank sends
B bytes, unevenly over E = W x experts-per-rank experts) go through ``moe.alltoall``'s ``flat_plan``
and ``hierarchical_plan`` executed by ``Exchange`` (forward only, the layer's own ops: all-to-alls and
the reorders around them; plans are built outside the timing). Each rank checks that both deliver
identical rows. Printed per size: measured flat and hierarchical ms (median over iterations, slowest
rank), and ``moe.topology``'s predictions with the fitted intra link and (a) the assumed inter link,
what M real nodes would see, (b) inter = the fitted intra link, what this one host actually has.

Slow inter-node link (``--slow-inter gloo``, exchange mode): every byte that crosses nodes goes pairwise over
a gloo (TCP) group through pinned host memory (device -> host copy, gloo send/recv, host -> device copy),
while traffic inside a node stays on NCCL. The flat exchange sends its on-node pieces over the node's NCCL
group and, at the same time, its W - L off-node pieces over gloo; the hierarchical one runs its intra step on
NCCL and its inter step over gloo: both see the same links. The slow link is fitted like the intra one (a
sweep of all-to-alls over the ranks with one local index, M of them, through the same transport); a
second sweep over flat's fan-out (each rank to its W - L off-node ranks) splits the slow link's fixed cost into
per call and per peer, and a probe of the exchange machinery (a one-step ``Exchange`` against the bare
all_to_all_single it wraps) gives the cost per exchange step (flat pays it once, hierarchical twice). The cost
model gets both fitted links and the step cost, and the bench prints per size measured flat and hierarchical ms
next to the predictions, the predicted crossover (``moe.topology.crossover_bytes``), the measured one
(interpolated in log bytes between the last size where hierarchical wins and the next), their ratio, and how far
the measured crossover moves if one size's hierarchical time moved by 2% (how well the run pins it):

    torchrun --nproc-per-node 4 bench/moe_alltoall.py --ranks-per-node 2 --slow-inter gloo \
        --log-file runs/moe_alltoall_2x2_gloo.log
    torchrun --nproc-per-node 4 bench/moe_alltoall.py --ranks-per-node 2 --slow-inter gloo --max-mib 0.25 \
        --iters 2 --log-file /tmp/moe_alltoall_2x2_gloo.log                             # CPU check (gloo)
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.alltoall import Exchange, ExchangePlan, flat_plan, hierarchical_plan  # noqa: E402
from moe.topology import (  # noqa: E402
    ExpertParallelGroups,
    Link,
    build_expert_parallel_groups,
    crossover_bytes,
    crossover_under_noise,
    fit_link,
    flat_all_to_all_s,
    hierarchical_all_to_all_s,
    measured_crossover_bytes,
)

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
    parser.add_argument("--slow-inter", choices=["gloo"],
                        help="exchange mode: carry every inter-node byte over gloo (TCP) through host memory, fit "
                             "that link, and compare the measured crossover with the cost model's")
    args = parser.parse_args()
    if args.slow_inter and args.ranks_per_node is None:
        parser.error("--slow-inter needs --ranks-per-node (exchange mode)")
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


def link_name(device: torch.device, transport: GlooOffNode | None) -> str:
    if transport is not None:
        return "gloo over TCP" + (", staged through pinned host memory" if device.type == "cuda" else "")
    return "NCCL" if device.type == "cuda" else "gloo"


class _Done:
    """The work of a step that finished before its launch returned."""

    def wait(self) -> None:
        return None


class GlooOffNode:
    """A ``moe.alltoall.Transport``: one all-to-all step over ``peers`` (global ranks, in the step's order) whose
    off-node pieces go pairwise over ``gloo`` through host memory, one message per off-node peer, while the
    on-node pieces go over ``intra`` (the node's ranks in local order, NCCL on GPUs) at the same time. Without
    ``intra`` the only on-node peer must be this rank (the hierarchical exchange's inter-node step).

    The gloo part is synchronous (the host waits for it); the NCCL part is returned as the work to wait for."""

    def __init__(self, peers: list[int], ranks_per_node: int, gloo: dist.ProcessGroup,
                 intra: dist.ProcessGroup | None, device: torch.device) -> None:
        self.peers, self.gloo, self.intra, self.device = peers, gloo, intra, device
        me = dist.get_rank()
        node = me // ranks_per_node
        self.on_node = [i for i, peer in enumerate(peers) if peer // ranks_per_node == node]
        if intra is None and self.on_node != [peers.index(me)]:
            raise ValueError(f"GlooOffNode: peers {peers} hold other ranks of node {node}; pass the node's group")
        if intra is not None and self.on_node != list(range(self.on_node[0], self.on_node[-1] + 1)):
            raise ValueError(f"GlooOffNode: the node's ranks are not consecutive in {peers}")
        self.off_node = [i for i in range(len(peers)) if i not in self.on_node]
        self._buffers: dict[str, torch.Tensor] = {}

    def _host(self, name: str, num_bytes: int) -> torch.Tensor:
        """A reused host byte buffer (pinned on GPUs: pinning per call would cost more than the copy)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < num_bytes:
            buffer = torch.empty(max(num_bytes, 1), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._buffers[name] = buffer
        return buffer[:num_bytes]

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int]) -> object:
        send_at = [0, *itertools.accumulate(input_split_sizes)]
        recv_at = [0, *itertools.accumulate(output_split_sizes)]
        work: object = _Done()
        if self.intra is not None:  # on-node pieces: NCCL, in flight while the gloo part runs
            lo, hi = self.on_node[0], self.on_node[-1] + 1
            work = dist.all_to_all_single(output[recv_at[lo]:recv_at[hi]], input[send_at[lo]:send_at[hi]],
                                          output_split_sizes[lo:hi], input_split_sizes[lo:hi], group=self.intra,
                                          async_op=True)
        else:
            mine = self.on_node[0]
            output[recv_at[mine]:recv_at[mine + 1]].copy_(input[send_at[mine]:send_at[mine + 1]])
        in_bytes = input.reshape(input.shape[0], -1).view(torch.uint8)  # [rows, bytes per row]
        out_bytes = output.reshape(output.shape[0], -1).view(torch.uint8)
        sends = [in_bytes[send_at[i]:send_at[i + 1]].reshape(-1) for i in self.off_node]
        recvs = [out_bytes[recv_at[i]:recv_at[i + 1]].reshape(-1) for i in self.off_node]
        host_send = self._host("send", sum(t.numel() for t in sends))
        host_recv = self._host("recv", sum(t.numel() for t in recvs))
        if sends:
            host_send.copy_(torch.cat(sends))  # device -> host (waits for the rows)
        ops, at_send, at_recv = [], 0, 0
        for i, send, recv in zip(self.off_node, sends, recvs):
            if recv.numel():
                ops.append(dist.irecv(host_recv[at_recv:at_recv + recv.numel()], src=self.peers[i], group=self.gloo))
            if send.numel():
                ops.append(dist.isend(host_send[at_send:at_send + send.numel()], dst=self.peers[i], group=self.gloo))
            at_send, at_recv = at_send + send.numel(), at_recv + recv.numel()
        for op in ops:
            op.wait()
        arrived = host_recv.to(self.device)  # (synchronous: the buffer is reused by the next call)
        at = 0
        for recv in recvs:  # host -> device, then into the output's off-node pieces
            recv.copy_(arrived[at:at + recv.numel()])
            at += recv.numel()
        return work


def measure_link(device: torch.device, iters: int, sizes: list[int],
                 group: dist.ProcessGroup | None = None, transport: GlooOffNode | None = None,
                 points: list | None = None) -> tuple[Link, list[str]]:
    """Time all_to_all_single over ``group`` (default: all ranks), or through ``transport`` over its peers,
    per size and fit an alpha-beta link (``moe.topology.fit_link``: relative error).

    Args:
        points: if given, the (peers, bytes moved, seconds) probe points are appended to it.

    Returns:
        The fitted link and the raw lines (the same on every rank).
    """
    ranks = len(transport.peers) if transport is not None else dist.get_world_size(group)
    points = [] if points is None else points
    lines, first = [], len(points)
    for size in sizes:
        numel = size // 2 - size // 2 % ranks
        send = torch.empty(numel, dtype=torch.bfloat16, device=device)
        recv = torch.empty_like(send)
        splits = [numel // ranks] * ranks
        times_s = []
        for i in range(iters + WARMUP_ITERS):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            if transport is not None:
                transport.all_to_all_single(recv, send, splits, splits).wait()
            else:
                dist.all_to_all_single(recv, send, group=group)
            synchronize(device)
            if i >= WARMUP_ITERS:
                times_s.append(time.perf_counter() - start)
        seconds = slowest_s(statistics.median(times_s), device)
        moved_bytes = size * (ranks - 1) / ranks
        points.append((ranks - 1, moved_bytes, seconds))
        lines.append(f"  {size / 2 ** 20:9.3f} MiB per rank: {seconds * 1e6:9.1f} us, "
                     f"{moved_bytes / seconds / 1e9:7.1f} GB/s per GPU off-rank")
    link = fit_link(points[first:])
    lines.append(f"  fit: alpha {link.latency_s * 1e6:.2f} us per message, "
                 f"bandwidth {link.bandwidth_bytes_per_s / 1e9:.1f} GB/s per GPU "
                 f"({ranks} ranks, {link_name(device, transport)})")
    return link, lines


def measure_intra(iters: int, max_mib: float = 256.0) -> tuple[Link, list[str]]:
    """All-to-all times between the ranks of this host; returns the fitted link and (rank 0) the raw lines."""
    device = init_device()
    link, lines = measure_link(device, iters, sizes_bytes(max_mib))
    is_main = dist.get_rank() == 0
    dist.destroy_process_group()
    return (link, lines) if is_main else (link, [])


def table(intra: Link, inter: Link, gpus_per_node: int, step_s: float = 0.0) -> list[str]:
    head = f"| nodes x GPUs | {' | '.join(f'{b / 2 ** 20:g} MiB: flat / hier (ms)' for b in TABLE_BYTES)} | crossover |"
    lines = [head, "|" + "---|" * (len(TABLE_BYTES) + 2)]
    for nodes in NODES:
        cells = []
        for size in TABLE_BYTES:
            flat = flat_all_to_all_s(size, gpus_per_node, nodes, intra, inter, step_s=step_s) * 1e3
            hier = hierarchical_all_to_all_s(size, gpus_per_node, nodes, intra, inter, step_s=step_s) * 1e3
            cells.append(f"{flat:.3f} / {hier:.3f}{' **H**' if hier < flat else ''}")
        cross = crossover_bytes(gpus_per_node, nodes, intra, inter, step_s=step_s)
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


def exchange_one_size(args, groups: ExpertParallelGroups, size_bytes: int, device: torch.device,
                      slow: tuple[GlooOffNode, GlooOffNode] | None = None) -> dict:
    """Route the same counts through the flat and the hierarchical plan; time both, compare rows. With ``slow``
    (flat's and the inter step's transports) every inter-node byte goes over the slow link."""
    row_bytes = args.hidden * 2  # bf16
    counts_WE = token_counts(size_bytes, row_bytes, groups.size, groups.size * args.experts_per_rank, args.seed)
    generator = torch.Generator().manual_seed(args.seed + 7919 * (groups.rank + 1))
    rows_ND = torch.randn(sum(counts_WE[groups.rank]), args.hidden, generator=generator).to(device, torch.bfloat16)
    flat_group, inter_group = slow if slow is not None else (groups.group, groups.inter)
    flat = flat_plan(counts_WE, groups.rank, flat_group)
    hier = hierarchical_plan(counts_WE, groups.rank, groups.ranks_per_node, groups.intra, inter_group)
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


def measured_crossover(results: list[dict]) -> tuple[float | None, str]:
    """``moe.topology.measured_crossover_bytes`` of the results, and a note; None when hierarchical never wins or
    still wins at the largest size."""
    wins = [i for i, r in enumerate(results) if r["hier_s"] < r["flat_s"]]
    if not wins:
        return None, "never (hierarchical slower at every size)"
    if wins[-1] == len(results) - 1:
        return None, f"above the largest size ({results[-1]['bytes'] / 2 ** 20:.3f} MiB: hierarchical faster there)"
    cross = measured_crossover_bytes([(r["bytes"], r["flat_s"], r["hier_s"]) for r in results])
    note = (f" (hierarchical also wins at {len(wins) - 1} smaller sizes of {wins[-1]})"
            if len(wins) - 1 < wins[-1] else "")
    return cross, f"{cross / 2 ** 20:.3f} MiB{note}"


def crossover_spread(results: list[dict], noise: float = 0.02) -> str:
    """How far the measured crossover moves if each hierarchical time were ``noise`` faster or slower (one size
    at a time): a ratio near 1 over many sizes makes the crossover itself a noisy measurement."""
    found = crossover_under_noise([(r["bytes"], r["flat_s"], r["hier_s"]) for r in results], noise)
    known = [f / 2 ** 20 for f in found if f is not None]
    span = f"{min(known):.3f} .. {max(known):.3f} MiB" if known else "no crossover"
    return (f"measured crossover if one size's hierarchical time moved by {noise:.0%}: {span}"
            f"{f' (or none in {len(found) - len(known)} of {len(found)} cases)' if len(known) < len(found) else ''}")


def slow_lines(results: list[dict], groups: ExpertParallelGroups, intra: Link, inter: Link, step_s: float) -> list[str]:
    """Measured flat / hierarchical with the slow inter link against the cost model with both fitted links."""
    lpn, nodes = groups.ranks_per_node, groups.nodes
    lines = ["| bytes per rank | flat ms | hier ms | hier / flat | predicted flat / hier ms (fitted links, step) "
             "| predicted hier / flat | identical rows |", "|---|---|---|---|---|---|---|"]
    for r in results:
        flat = flat_all_to_all_s(r["bytes"], lpn, nodes, intra, inter, step_s=step_s)
        hier = hierarchical_all_to_all_s(r["bytes"], lpn, nodes, intra, inter, step_s=step_s)
        lines.append(f"| {r['bytes'] / 2 ** 20:.3f} MiB | {r['flat_s'] * 1e3:.3f} | {r['hier_s'] * 1e3:.3f} | "
                     f"{r['hier_s'] / r['flat_s']:.2f}{' **H**' if r['hier_s'] < r['flat_s'] else ''} | "
                     f"{flat * 1e3:.3f} / {hier * 1e3:.3f} | {hier / flat:.2f}{' **H**' if hier < flat else ''} | "
                     f"{r['identical']} |")
    lines.append("identical received rows (flat vs hierarchical, every rank, every size): "
                 f"{all(r['identical'] for r in results)}")
    predicted = crossover_bytes(lpn, nodes, intra, inter, step_s=step_s)
    measured, note = measured_crossover(results)
    lines.append(f"crossover (largest bytes per rank at which hierarchical wins): predicted "
                 f"{'never' if predicted is None else f'{predicted / 2 ** 20:.3f} MiB'}, measured {note}")
    if predicted is not None and measured is not None:
        ratio = predicted / measured
        within = "within" if abs(ratio - 1) <= 0.2 else "outside"
        lines.append(f"predicted / measured crossover: {ratio:.2f} ({within} 20%)")
    else:
        agree = (predicted is None) == (measured is None and note.startswith("never"))
        lines.append("predicted / measured crossover: no ratio "
                     f"(model and measurement {'agree' if agree else 'disagree'})")
    lines.append(crossover_spread(results))
    return lines


def slow_transports(groups: ExpertParallelGroups, device: torch.device) -> tuple[GlooOffNode, GlooOffNode, GlooOffNode]:
    """Flat's transport (on-node over the node's group, off-node over gloo), the inter step's (over gloo, M - 1
    peers) and a probe's with flat's off-node fan-out (over gloo to the W - L off-node ranks, nothing on-node)."""
    world, lpn, me = dist.get_world_size(), groups.ranks_per_node, dist.get_rank()
    gloo = dist.new_group(list(range(world)), backend="gloo")  # every rank, the same call
    local = me % lpn
    flat = GlooOffNode(list(range(world)), lpn, gloo, groups.intra, device)
    inter = GlooOffNode(list(range(local, world, lpn)), lpn, gloo, None, device)
    fanout = GlooOffNode([r for r in range(world) if r == me or r // lpn != me // lpn], lpn, gloo, None, device)
    return flat, inter, fanout


def run_exchanges(args, inter: Link) -> list[str]:
    """Exchange mode: fit the intra-node link, then time flat against hierarchical per size (rank 0 gets the lines)."""
    device = init_device()
    world = dist.get_world_size()
    if args.ranks_per_node < 2 or world % args.ranks_per_node or world // args.ranks_per_node < 2:
        raise SystemExit(f"--ranks-per-node {args.ranks_per_node}: needs >= 2 nodes of >= 2 ranks on {world} ranks")
    groups = build_expert_parallel_groups(world, args.ranks_per_node)
    sizes = sizes_bytes(args.max_mib)
    intra, fit_lines = measure_link(device, args.iters, sizes, groups.intra)
    if args.slow_inter:
        return slow_exchanges(args, groups, device, sizes, intra, fit_lines)
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


def measure_step_s(args, groups: ExpertParallelGroups, device: torch.device, size_bytes: int) -> tuple[float, str]:
    """The exchange machinery's cost per all-to-all step (``moe.topology``'s ``step_s``): a one-step flat exchange
    over the node's ranks (``Exchange``: the autograd launch and wait, the reorder) against the bare
    all_to_all_single it wraps, the same rows, timed alternately; the difference of the medians, slowest rank."""
    lpn, row_bytes = groups.ranks_per_node, args.hidden * 2
    counts_WE = token_counts(size_bytes, row_bytes, lpn, lpn * args.experts_per_rank, args.seed)
    plan = flat_plan(counts_WE, groups.rank % lpn, groups.intra)
    step = plan.ops[0]
    rows_ND = torch.randn(sum(counts_WE[groups.rank % lpn]), args.hidden).to(device, torch.bfloat16)
    out_ND = rows_ND.new_empty((sum(step.recv), args.hidden))
    bare, wrapped = [], []
    with torch.no_grad():
        for i in range(args.iters + WARMUP_ITERS):
            for times_s, run in ((bare, lambda: dist.all_to_all_single(out_ND, rows_ND, step.recv, step.send,
                                                                       group=groups.intra)),
                                 (wrapped, lambda: Exchange(plan.ops, rows_ND).finish())):
                dist.barrier()
                synchronize(device)
                start = time.perf_counter()
                run()
                synchronize(device)
                if i >= WARMUP_ITERS:
                    times_s.append(time.perf_counter() - start)
    bare_s, wrapped_s = slowest_s(statistics.median(bare), device), slowest_s(statistics.median(wrapped), device)
    return max(wrapped_s - bare_s, 0.0), (f"exchange step overhead ({size_bytes / 2 ** 20:.3f} MiB per rank, "
                                          f"{lpn} ranks): Exchange {wrapped_s * 1e6:.1f} us, bare all_to_all_single "
                                          f"{bare_s * 1e6:.1f} us: step {max(wrapped_s - bare_s, 0.0) * 1e6:.1f} us")


def slow_exchanges(args, groups: ExpertParallelGroups, device: torch.device, sizes: list[int], intra: Link,
                   fit_lines: list[str]) -> list[str]:
    """--slow-inter: fit the slow inter link (M - 1 and W - L peers), probe the step overhead, time both
    exchanges over the slow link, compare with the cost model."""
    flat_transport, inter_transport, fanout = slow_transports(groups, device)
    points: list = []
    _, inter_lines = measure_link(device, args.iters, sizes, transport=inter_transport, points=points)
    _, fanout_lines = measure_link(device, args.iters, sizes, transport=fanout, points=points)
    inter = fit_link(points)  # both fan-outs: call_s + peers * latency_s + bytes / bandwidth
    step_s, step_line = measure_step_s(args, groups, device, sizes[0])
    results = [exchange_one_size(args, groups, size, device, (flat_transport, inter_transport)) for size in sizes]
    world = dist.get_world_size()
    lines = [f"MoE exchange, {world} ranks as {groups.nodes} nodes x {groups.ranks_per_node}, inter-node link made "
             f"slow: {link_name(device, inter_transport)} | "
             f"{'NCCL ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else 'gloo cpu'} inside nodes | "
             f"{groups.size * args.experts_per_rank} experts, rows of {args.hidden} bf16, {args.iters} iterations",
             f"flat all-to-all inside each node ({groups.ranks_per_node} ranks), the intra-node fit:", *fit_lines,
             f"all-to-all over the slow link among the {groups.nodes} ranks of one local index "
             f"({groups.nodes - 1} peers):", *inter_lines,
             f"the slow link from each rank to the {world - groups.ranks_per_node} off-node ranks (flat's fan-out):",
             *fanout_lines,
             f"intra: {intra.latency_s * 1e6:.2f} us per peer + {intra.call_s * 1e6:.2f} us per call, "
             f"{intra.bandwidth_bytes_per_s / 1e9:.2f} GB/s per GPU | inter (fitted on both fan-outs, slow): "
             f"{inter.latency_s * 1e6:.2f} us per peer + {inter.call_s * 1e6:.2f} us per call, "
             f"{inter.bandwidth_bytes_per_s / 1e9:.2f} GB/s per GPU",
             step_line,
             "flat: on-node pieces over NCCL while the off-node ones go over the slow link; hierarchical: intra step "
             "over NCCL, inter step over the slow link; ms = median of the slowest rank; forward only; **H** = "
             "hierarchical faster",
             *slow_lines(results, groups, intra, inter, step_s),
             f"cost model for N nodes x {args.gpus_per_node} with both fitted links (a forecast, not measured):",
             *table(intra, inter, args.gpus_per_node, step_s)]
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
