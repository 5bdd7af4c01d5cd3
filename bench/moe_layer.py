"""MoE layer throughput: this repo's ``moe.layer.MoE`` against ``deepspeed.moe.layer.MoE`` in one process.

    python bench/moe_layer.py --log-file runs/moe_layer_1gpu.log                      # 1 GPU, ep_size 1
    torchrun --nproc-per-node 2 bench/moe_layer.py --log-file runs/moe_layer_2gpu.log # 2 GPUs, ep_size 2
    torchrun --nproc-per-node 4 bench/moe_layer.py --ranks-per-node 2 --hierarchical off on \
        --log-file runs/moe_layer_4gpu.log                # 4 GPUs as 2 nodes x 2: flat and hierarchical
    python bench/moe_layer.py --device cpu --tiny --log-file /tmp/moe_layer_cpu.log  # end-to-end check on CPU

Both layers get the same gate weight and the same expert weights (expert e of the global numbering is
initialised from seed e on whichever rank holds it), the same input and the same upstream gradient,
and route identically: top-k with k-major (GShard) capacity priority, no second-expert sampling, no
random token selection. Before timing, the outputs, l_aux and exp_counts are compared and printed.

``--ranks-per-node L`` treats the W ranks as W / L nodes (default: the launcher's LOCAL_WORLD_SIZE);
``--hierarchical off on auto`` times our layer once per setting (``moe.hierarchical_all_to_all``
false / true / "auto"), next to one DeepSpeed timing per shape; each row names the exchange the layer
actually used ("on" needs more than one node: L < W).

Timed: forward + backward of the layer alone (CUDA events, median over rounds), tokens/s per rank,
and the ratio DeepSpeed time / our time. Shapes: tokens T per rank, model dim D, expert width F,
experts E, top-k, capacity factor; the expert is ``Sequential(Linear(D, F), GELU(), Linear(F, D))``
without biases (as in Mixtral / DeepSeek-MoE; ``--bias`` adds them).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import build_expert_parallel_groups, ranks_per_node_from_env  # noqa: E402
from moe.layer import MoE  # noqa: E402

# (name, tokens per rank, D, F, experts, k, capacity factor)
CONFIGS = [
    ("coarse  E=8  k=2", 16384, 2048, 8192, 8, 2, 1.25),
    ("medium  E=32 k=2", 16384, 2048, 2048, 32, 2, 1.25),
    ("fine    E=64 k=4", 16384, 2048, 1024, 64, 4, 1.25),
]
HIERARCHICAL = {"off": False, "on": True, "auto": "auto"}
"""--hierarchical values -> moe.hierarchical_all_to_all."""
TINY = [("tiny    E=8  k=2", 256, 64, 128, 8, 2, 1.25), ("tiny    E=16 k=4", 256, 64, 64, 16, 4, 1.25)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-file", required=True, help="file the results are written to (rank 0)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="small shapes, for a CPU check")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per round (default 20, tiny 3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bias", action="store_true", help="experts with biases")
    parser.add_argument("--overlap-chunks", type=int, nargs="+", default=[1, 2],
                        help="our overlap chunk counts to time when ep_size > 1")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="L: treat the ranks as nodes of L (default: the launcher's LOCAL_WORLD_SIZE)")
    parser.add_argument("--hierarchical", nargs="+", default=["off"], choices=list(HIERARCHICAL),
                        help="our all-to-all settings to time when ep_size > 1 (moe.hierarchical_all_to_all)")
    return parser.parse_args()


def init_dist(device: str) -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    import deepspeed  # DeepSpeed's expert groups need deepspeed.comm initialised

    local = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    here = torch.device(device, local) if device == "cuda" else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), here


def expert_weights(global_id: int, d: int, f: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + global_id)
    return [torch.randn(f, d, generator=g) / d ** 0.5, torch.randn(f, generator=g) * 0.02,
            torch.randn(d, f, generator=g) / f ** 0.5, torch.randn(d, generator=g) * 0.02]


def common_kwargs(cfg, ep_size: int) -> dict:
    """The constructor arguments both layers share (identical routing: k-major capacity, no sampling, no RTS)."""
    _, _, _, _, experts, k, cf = cfg
    return dict(num_experts=experts, ep_size=ep_size, k=k, capacity_factor=cf, eval_capacity_factor=cf,
                min_capacity=4, drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)


def expert_template(cfg, bias: bool) -> nn.Module:
    _, _, d, f, _, _, _ = cfg
    return nn.Sequential(nn.Linear(d, f, bias=bias), nn.GELU(), nn.Linear(f, d, bias=bias))


def build_theirs(cfg, ep_size: int, rank: int, device, dtype, bias: bool = False) -> nn.Module:
    """deepspeed.moe's layer with the seeded gate and this rank's seeded experts."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    _, _, d, f, experts, _, _ = cfg
    torch.manual_seed(0)  # same gate on every rank
    theirs = DeepSpeedMoE(d, expert_template(cfg, bias), **common_kwargs(cfg, ep_size))
    if ep_size > 1:
        theirs.set_deepspeed_parallelism()
    local = experts // ep_size
    with torch.no_grad():
        for j, module in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
            w1, b1, w2, b2 = expert_weights(rank * local + j, d, f)
            module[0].weight.copy_(w1)
            module[2].weight.copy_(w2)
            if bias:
                module[0].bias.copy_(b1)
                module[2].bias.copy_(b2)
    return theirs.to(device, dtype)


def build_ours(cfg, ep_size: int, rank: int, device, dtype, theirs: nn.Module, ep_groups, chunks: int,
               hierarchical: bool | str, ranks_per_node: int, bias: bool = False) -> nn.Module:
    """Our layer with ``theirs``'s gate and the same seeded experts; ``hierarchical`` is
    moe.hierarchical_all_to_all, ``ranks_per_node`` moe.ranks_per_node."""
    _, _, d, f, experts, _, _ = cfg
    ours = MoE(d, expert_template(cfg, bias), **common_kwargs(cfg, ep_size), ep_groups=ep_groups,
               overlap_chunks=chunks, hierarchical_all_to_all=hierarchical, ranks_per_node=ranks_per_node)
    local = experts // ep_size
    with torch.no_grad():
        ours.deepspeed_moe.router.wg.weight.copy_(theirs.deepspeed_moe.gate.wg.weight)
        grouped = ours.deepspeed_moe.experts
        for j in range(local):
            w1, b1, w2, b2 = expert_weights(rank * local + j, d, f)
            grouped.w_in_LDF[j].copy_(w1.t())
            grouped.w_out_LFD[j].copy_(w2.t())
            if bias:
                grouped.b_in_LF[j].copy_(b1)
                grouped.b_out_LD[j].copy_(b2)
    return ours.to(device, dtype)


def step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    out, l_aux, _ = layer(x)
    torch.autograd.backward([out, l_aux], [grad, torch.ones_like(l_aux)])


def time_layer(layer, x, grad, iters: int, rounds: int, device) -> float:
    """Median seconds per forward + backward over ``rounds`` rounds of ``iters`` iterations."""
    for _ in range(3):
        step(layer, x, grad)
    results = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            step(layer, x, grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        results.append((time.perf_counter() - start) / iters)
    return statistics.median(results)


def slowest(seconds: float, world: int, device) -> float:
    """The slowest rank's time (every rank waits for it at the next collective anyway)."""
    if world == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def compare(theirs, ours, x) -> str:
    with torch.no_grad():
        out_t, aux_t, counts_t = theirs(x)
        out_o, aux_o, counts_o = ours(x)
    same_counts = torch.equal(counts_t.long().cpu(), counts_o.cpu())
    diff = (out_t.float() - out_o.float()).abs().max().item()
    scale = out_t.float().abs().max().item()
    return (f"identical routing check: exp_counts equal={same_counts}, l_aux {aux_t.item():.6f} vs {aux_o.item():.6f}, "
            f"max |out diff| {diff:.3e} (max |out| {scale:.3e})")


def expert_parallel_groups(args, world: int):
    """Our expert-parallel groups (W = world, nodes of L ranks) and L; checks the --hierarchical settings."""
    if world == 1:
        if args.hierarchical != ["off"]:
            raise SystemExit("--hierarchical on/auto needs ep_size > 1 (run under torchrun)")
        return None, 1
    ranks_per_node = ranks_per_node_from_env(args.ranks_per_node)
    groups = build_expert_parallel_groups(world, ranks_per_node)
    if "on" in args.hierarchical and groups.intra is None:
        raise SystemExit(f"--hierarchical on: {world} ranks with {ranks_per_node} per node are one node; "
                         f"pass --ranks-per-node below {world}")
    return groups, ranks_per_node


class ChoiceLog(logging.Handler):
    """Keeps the MoE layer's INFO lines (its all-to-all choice and why) for the log file."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


CHOICES = ChoiceLog()
logging.getLogger("moe.layer").addHandler(CHOICES)
logging.getLogger("moe.layer").setLevel(logging.INFO)


def time_shape(args, cfg, rank, world, device, dtype, ep_groups, ranks_per_node, iters) -> list[str]:
    """One DeepSpeed timing, then ours per (overlap chunks, hierarchical setting), each after the routing check."""
    name, tokens, d, f, experts, k, cf = cfg
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(tokens, d, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(tokens, d, generator=g).to(device, dtype)
    theirs = build_theirs(cfg, world, rank, device, dtype, args.bias)
    t_ds = slowest(time_layer(theirs, x, grad, iters, args.rounds, device), world, device)
    lines = []
    for chunks in (args.overlap_chunks if world > 1 else [1]):
        for setting in args.hierarchical:
            ours = build_ours(cfg, world, rank, device, dtype, theirs, ep_groups, chunks, HIERARCHICAL[setting],
                              ranks_per_node, args.bias)
            CHOICES.take()
            check = compare(theirs, ours, x)
            used = "hier" if ours.deepspeed_moe.last_hierarchical else "flat"
            why = CHOICES.take()  # the layer's own line (its first forward): the choice and the reason
            t_ours = slowest(time_layer(ours, x, grad, iters, args.rounds, device), world, device)
            lines.append(f"{name} T={tokens} D={d} F={f} cf={cf} chunks={chunks} a2a={setting}->{used} | "
                         f"deepspeed {t_ds * 1e3:8.2f} ms {tokens / t_ds:12,.0f} tok/s | ours {t_ours * 1e3:8.2f} ms "
                         f"{tokens / t_ours:12,.0f} tok/s | speedup {t_ds / t_ours:.2f}x\n    {check}"
                         + "".join(f"\n    layer log: {line}" for line in why))
            del ours
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return lines


def main() -> None:
    args = parse_args()
    rank, world, device = init_dist(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    iters = args.iters or (3 if args.tiny else 20)
    ep_groups, ranks_per_node = expert_parallel_groups(args, world)
    nodes = world // min(ranks_per_node, world)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"MoE layer forward+backward | device {name}"
             f" | ranks {world} (ep_size {world}, {nodes} nodes x {min(ranks_per_node, world)}) | dtype {dtype} | "
             f"torch {torch.__version__} | grouped_mm {hasattr(torch, '_grouped_mm')} | expert biases {args.bias} | "
             f"deepspeed timed once per shape; a2a = our setting -> the exchange used"]
    for cfg in TINY if args.tiny else CONFIGS:
        lines += time_shape(args, cfg, rank, world, device, dtype, ep_groups, ranks_per_node, iters)
    if rank == 0:
        text = "\n".join(lines) + "\n"
        print(text, end="")
        Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log_file).write_text(text)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
