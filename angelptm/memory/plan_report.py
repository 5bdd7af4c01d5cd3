"""``pretrain.py --plan``: where ZeRO-Cache would put a config's model states, as a table people can read.

It plans every rank with :func:`zero_cache.dry_run` on a meta-device model (nothing is allocated), for
this machine or for one named on the command line (``--gpus 8 --device-memory 80GiB --host-memory 1TiB
--nvme 8TB``), and prints: the tiers with their budgets and planned bytes, where the param chunks and
optimizer groups go, and the floors each stream puts under the step time, so the step's bound is visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import zero_cache
from angelptm.config import EngineConfig
from angelptm.errors import ConfigError
from angelptm.pretraining.models import build_model
from zero_cache import DEVICE, HOST, NVME, Plan
from zero_cache.plan.host_memory import describe_host

DEFAULT_TFLOPS = 400.0
"""Model TFLOPS one GPU sustains, for the compute floor: an H200's bf16 GPT figures are 419-472
(DESIGN.md); an A100 or a 24 GB card sustains less, so pass ``--tflops`` for them."""


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What ``--plan`` was asked: the ranks, and the machine (None = this one, measured)."""

    ranks: int = 1
    ranks_per_host: int | None = None
    hardware: zero_cache.Hardware | None = None
    tflops: float = DEFAULT_TFLOPS


def named_hardware(*, gpus: int | None, device_memory: str | None, host_memory: str | None,
                   nvme: str | None) -> zero_cache.Hardware | None:
    """The machine the command line names, or None when it names none (plan for this one).

    Raises:
        ConfigError: part of it is named (device and host memory are both needed), or a size is unreadable.
    """
    if gpus is None and device_memory is None and host_memory is None and nvme is None:
        return None
    if device_memory is None or host_memory is None:
        raise ConfigError("--plan for named hardware needs both --device-memory (one GPU, e.g. 80GiB) and "
                          "--host-memory (one host's RAM, e.g. 1TiB); --gpus (per host) and --nvme are optional")
    try:
        return zero_cache.Hardware(
            device_bytes=zero_cache.parse_bytes(device_memory, name="--device-memory"),
            host_bytes=zero_cache.parse_bytes(host_memory, name="--host-memory"),
            gpus_per_host=gpus if gpus is not None else 1,
            nvme_bytes=zero_cache.parse_bytes(nvme, name="--nvme") if nvme is not None else 0)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def plan_report(cfg: EngineConfig, request: PlanRequest) -> tuple[str, bool]:
    """The plan of ``cfg`` for ``request`` as text, and whether the model fits.

    Raises:
        ConfigError: inconsistent ranks.
    """
    ranks, hardware = request.ranks, request.hardware
    per_host = request.ranks_per_host or (min(hardware.gpus_per_host, ranks) if hardware is not None else ranks)
    if ranks < 1 or not 1 <= per_host <= ranks:
        raise ConfigError(f"--ranks {ranks} --ranks-per-host {per_host}: need 1 <= ranks-per-host <= ranks")
    with torch.device("meta"):
        model = build_model(cfg.model, moe=cfg.moe)
    device = torch.device("cuda") if hardware is not None or torch.cuda.is_available() else torch.device("cpu")
    head = [f"model     {cfg.model.flavour}, {_count(model.num_params())} parameters, "
            f"{str(cfg.precision.dtype).removeprefix('torch.')} ({cfg.precision.reason})",
            f"machine   {_describe_machine(hardware, ranks, per_host, device)}"]
    if not cfg.zero_cache.enabled:
        return "\n".join(head + ["zero_cache is not enabled in this config: every rank holds all model states on "
                                 "its device"]), True
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    try:
        run = zero_cache.dry_run(shapes, cfg.zero_cache, compute_dtype=cfg.precision.dtype, device=device,
                                 accumulation_steps=cfg.batch.gradient_accumulation_steps,
                                 world_size=ranks, ranks_per_host=per_host, hardware=hardware)
    except zero_cache.PlanError as err:
        return "\n".join(head + [f"does not fit: {err}"]), False
    except zero_cache.NvmeSetupError as err:
        return "\n".join(head + [f"cannot use the NVMe tier: {err}"]), False
    layout, plan, budgets = run.layout, run.plan, run.resolved.budgets
    activation_reserve_bytes = run.resolved.activation_reserve_bytes
    seq_len = cfg.data.seq_len or cfg.model.max_seq_len
    tokens = cfg.batch.micro_batch_size * cfg.batch.gradient_accumulation_steps * seq_len
    # A GPU's model TFLOPS is a known figure; a CPU run's compute is not estimated.
    compute_s = model.flops_per_token(seq_len) * tokens / (request.tflops * 1e12) if device.type == "cuda" else None
    groups = f"; collective groups of {plan.group_size} chunks (one per rank)" if plan.group_size > 1 else ""
    lines = head + [
        f"layout    {layout.num_chunks} chunks of {layout.chunk_numel / 1e6:.1f} M elements "
        f"({100 * layout.waste_fraction:.1f}% padding){groups}",
        "",
        *_tier_table(plan, budgets, device),
        _host_line(plan.host_bytes, run.warmup_host_bytes, layout.used_numel),
        *_reserve_lines(activation_reserve_bytes, run.warmup_room_bytes),
        "",
        *_step_floors(plan, compute_s, tokens, request.tflops),
        f"summary   {plan.summary()}",
        "(rank 0's first plan, before the warm-up measures activations: it re-plans after step 1)",
    ]
    return "\n".join(lines), True


def _describe_machine(hardware: zero_cache.Hardware | None, ranks: int, per_host: int, device: torch.device) -> str:
    hosts = -(-ranks // per_host)
    layout = f"{ranks} rank{'s' if ranks > 1 else ''}" + (f" on {hosts} hosts of {per_host}" if hosts > 1 else "")
    if hardware is None:
        return f"this one, measured ({device.type}); {layout}"
    disk = f", NVMe {zero_cache.format_bytes(hardware.nvme_bytes)}" if hardware.nvme_bytes else ", no NVMe"
    return (f"named: {hardware.gpus_per_host} x GPU {zero_cache.format_bytes(hardware.device_bytes)} per host, "
            f"host RAM {zero_cache.format_bytes(hardware.host_bytes)}{disk}; {layout}")


def _host_line(host_bytes: int, warmup_host_bytes: int | None, num_params: int) -> str:
    """Rank 0's host bytes per parameter of the model: in the plan, and at the warm-up step where it runs under
    another placement (its peak: :func:`zero_cache.plan.host_memory.warmup_host_cap` bounds it)."""
    if warmup_host_bytes is None:
        return (f"host use  {describe_host(host_bytes, num_params)} in the plan, the warm-up's too (it runs under "
                "this plan)")
    return f"host use  {describe_host(host_bytes, num_params, warmup_host_bytes)}"


def _reserve_lines(activation_reserve_bytes: int, warmup_room_bytes: int | None) -> list[str]:
    """What the plan holds back for activations, and what the warm-up step leaves them where it runs at the
    plan's least device footprint (activation_memory "auto" on a GPU: the reserve is a guess)."""
    if warmup_room_bytes is not None:
        return [f"{zero_cache.format_bytes(activation_reserve_bytes)} of the device budget is held back for "
                "activations in this plan (zero_cache.activation_memory \"auto\", a guess); the warm-up step runs at "
                f"its least device footprint, leaving {zero_cache.format_bytes(warmup_room_bytes)} for them, and the "
                "re-plan after it uses the measured peak"]
    return [f"{zero_cache.format_bytes(activation_reserve_bytes)} of the device budget is held back for activations "
            "until the warm-up measures them (zero_cache.activation_memory)"] if activation_reserve_bytes else []


def _tier_table(plan: Plan, budgets: zero_cache.TierBudgets, device: torch.device) -> list[str]:
    """One row per tier: its per-rank budget, the bytes planned there, and which chunks' states it holds."""
    optimizer = {tier: plan.optimizer_tier.count(tier) for tier in (DEVICE, HOST, NVME)}
    owned = sum(optimizer.values())
    if plan.params_sharded or plan.param_home:
        kind = "shards" if plan.group_size > 1 else "chunks"
        params = {DEVICE: f"{plan.param_home.count(DEVICE)} {kind} at home, {plan.cache_slots} groups live"}
        params.update({tier: f"{plan.param_home.count(tier)} {kind} at home (streamed in on use)"
                       if tier in plan.param_home else "-" for tier in (HOST, NVME)})
    else:
        params = {DEVICE: "all resident", HOST: "-", NVME: "-"}
    budget = {DEVICE: budgets.device_bytes, HOST: budgets.host_bytes, NVME: budgets.nvme_bytes}
    planned = {DEVICE: plan.device_bytes, HOST: plan.host_bytes, NVME: plan.nvme_bytes}
    gpu_adam = "GPU Adam" if device.type == "cuda" else "device Adam"
    stepped = len(plan.device_stepped)
    update = {DEVICE: gpu_adam, HOST: "host Adam" + (f"; {stepped} by {gpu_adam} after backward" if stepped else ""),
              NVME: "host Adam via disk"}
    rows = [("tier", "budget/rank", "planned", "param chunks", f"optimizer groups (this rank owns {owned})")]
    for tier in (DEVICE, HOST, NVME):
        if tier == NVME and not budget[NVME]:
            rows.append((tier, "none", "-", "-", "-"))
            continue
        rows.append((tier, zero_cache.format_bytes(budget[tier]), zero_cache.format_bytes(planned[tier]),
                     params[tier], f"{optimizer[tier]} ({update[tier]})" if optimizer[tier] else "0"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _step_floors(plan: Plan, compute_s: float | None, tokens: int, tflops: float) -> list[str]:
    """Each stream's floor under the step (they overlap, so the largest bounds it) and which one that is."""
    traffic, rates = plan.traffic, plan.traffic.rates
    stream_s = traffic.floors
    floors = [("compute", f"{tokens:,} tokens/rank at {tflops:.0f} model TFLOPS", compute_s)] if compute_s else []
    floors += [
        ("H2D", f"{zero_cache.format_bytes(traffic.h2d_bytes)} at {rates.h2d_bytes_per_s / 2**30:.0f} GiB/s",
         stream_s["H2D"]),
        ("D2H", f"{zero_cache.format_bytes(traffic.d2h_bytes)} at {rates.d2h_bytes_per_s / 2**30:.0f} GiB/s",
         stream_s["D2H"]),
        ("host Adam", f"{_count(traffic.host_adam_elements)} elements at "
                      f"{rates.host_adam_elements_per_s / 1e9:.1f} G/s", stream_s["host Adam"]),
    ]
    if traffic.disk_bytes:
        # Optimizer groups there are read and written once a step; param shards at home there are read per gather
        # and written per update (and gradients waiting on disk, a write and a read each): all in disk_bytes.
        groups = 2 * (plan.nvme_bytes - plan.param_nvme_bytes)
        shards = traffic.disk_bytes - groups
        parts = [f"{zero_cache.format_bytes(groups)} of optimizer states" if groups else "",
                 f"{zero_cache.format_bytes(shards)} of param shards" if shards else ""]
        floors.append(("NVMe", f"{zero_cache.format_bytes(traffic.disk_bytes)} read and written "
                               f"({', '.join(part for part in parts if part)}) at "
                               f"{rates.disk_bytes_per_s / 1e9:.1f} GB/s", stream_s["disk"]))
    name, _, seconds = max(floors, key=lambda floor: floor[2])
    unseen = [] if compute_s else ["compute (not estimated on a CPU)"]
    unseen += ["the NCCL collectives"] if plan.group_size > 1 else []
    width = max(len(what) for _, what, _ in floors)
    lines = ["step floors (each runs on its own stream or thread; the largest bounds the step):"]
    lines += [f"  {stream:<9}  {what:<{width}}  {_seconds(floor):>9}" for stream, what, floor in floors]
    lines.append(f"  bound: {name}, at least {_seconds(seconds)} per step"
                 + (f" ({' and '.join(unseen)} not counted)" if unseen else ""))
    return lines


def _count(number: int) -> str:
    """``1.35 M`` / ``6.74 G``: parameter and element counts at a readable scale."""
    return f"{number / 1e9:.2f} G" if number >= 1e9 else f"{number / 1e6:.2f} M"


def _seconds(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"
