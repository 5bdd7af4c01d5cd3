"""ZeRO-Cache over data-parallel ranks (or one process): train, optionally resume / save, dump the fp32 weights.

    torchrun --nproc-per-node 4 tests/helpers/zero_cache_dp_job.py --global-batch 4 --data-seed S --steps 2 \
        --save-dir D --out FILE
    torchrun --nproc-per-node 2 tests/helpers/zero_cache_dp_job.py --global-batch 4 --data-seed S --steps 2 \
        --load D --out FILE

The device budget holds every param chunk and one optimizer group, so each rank's own groups are
split over the device and the host tier.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import SEQ, VOCAB, RandomTokens, end_job, open_files_under  # noqa: E402

import angelptm  # noqa: E402
from angelptm.pretraining.data import repeat_batches  # noqa: E402
from angelptm.pretraining.models import ModelConfig, build_model  # noqa: E402
from zero_cache.plan.host_memory import WARMUP_HOST_FACTOR  # noqa: E402
from zero_cache.plan.layout import pack  # noqa: E402
from zero_cache.plan.planner import DEVICE_MARGIN_FRACTION  # noqa: E402
from zero_cache.plan.working_set import GRADIENT_BUCKETS, GROUPS_IN_USE, budget_for_room  # noqa: E402

CHUNK_NUMEL = 8192


LIVE_GROUPS = 3
"""Sharded params: groups gathered at once (the least there is: the prefetch bucket below is at most one group, so
1 ahead + 2)."""


def device_budget(model: torch.nn.Module, world_size: int, accumulation: int, shard_params: bool) -> int:
    """Bytes for every (padded) fp32 param chunk (sharded params: one shard per group, and the gathered
    groups), the fp32 scratch chunk and one optimizer group (with its fp32 gradient accumulator and,
    sharded, the gradient buckets when micro-batches accumulate or params are sharded)."""
    layout = pack([(n, tuple(p.shape)) for n, p in model.named_parameters()], CHUNK_NUMEL)
    groups = -(-layout.num_chunks // world_size)
    params = groups if shard_params else groups * world_size
    group = 12 + (4 if accumulation > 1 else 0)
    buffers = GRADIENT_BUCKETS if world_size > 1 and (accumulation > 1 or shard_params) else 0
    buffers += LIVE_GROUPS if shard_params else 0
    need = (params * 4 + 4 + group + buffers * world_size * 4) * CHUNK_NUMEL
    return int(need / 0.97) + 1024  # the planner keeps 3% free


def least_working_set_budget(world_size: int) -> int:
    """Sharded params at home on the host: the least working set alone (the fp32 scratch chunk, the fewest live
    groups and two gradient buckets), so the plan must give up the third bucket (zero_cache.plan.working_set)."""
    need = (4 + (LIVE_GROUPS + GROUPS_IN_USE) * world_size * 4) * CHUNK_NUMEL
    return budget_for_room(need, DEVICE_MARGIN_FRACTION)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--data-seed", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-dir")
    parser.add_argument("--load")
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.5, help="0: no clipping")
    parser.add_argument("--no-overlap", action="store_true", help="zero_optimization.overlap_comm false")
    parser.add_argument("--after-backward", action="store_true", help="zero_cache.update_in_backward false")
    parser.add_argument("--hosts-of", type=int, default=None,
                        help="hierarchical collectives over hosts of this many ranks")
    parser.add_argument("--die-at-step", type=int, default=None, help="rank 1 exits (code 3) before this step")
    parser.add_argument("--shard-params", action="store_true", help="zero_cache.shard_params true (ZeRO-3)")
    parser.add_argument("--destroy", action="store_true", help="engine.destroy() at the end; the weights written are "
                        "the module's own then (and the swap files must be closed)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (recompute in backward)")
    parser.add_argument("--untied", action="store_true", help="separate embedding and output weights")
    parser.add_argument("--param-home", default="auto",
                        help="zero_cache.param_home (host: shards streamed from the host)")
    parser.add_argument("--least-working-set", action="store_true", help="with --shard-params --param-home host: a "
                        "device budget of the least working set (2 gradient buckets, not 3; "
                        "zero_cache.plan.working_set)")
    parser.add_argument("--nvme-path", help="zero_cache.nvme_path (with --param-home nvme: shards homed on the disk)")
    parser.add_argument("--device-steps", default="auto", help="zero_cache.device_steps (a count: host groups stepped "
                        "on the device after backward)")
    parser.add_argument("--warmup-least-footprint", action="store_true", help="the warm-up step at the plan's least "
                        "device footprint (a GPU's activation_memory \"auto\"), forced on this CPU")
    args = parser.parse_args()
    if args.warmup_least_footprint:
        importlib.import_module("zero_cache.attach").warms_up_at_least_footprint = lambda config, device: True
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0 if rank == 0 else 100 + rank)  # initialize() must broadcast rank 0's weights
    model = build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=3,
                                    hidden_size=32, num_heads=4, activation_checkpointing=args.checkpointing,
                                    tie_embeddings=not args.untied))
    shard_params = args.shard_params and world_size > 1
    config = {"train_micro_batch_size_per_gpu": args.global_batch // world_size,
              "gradient_accumulation_steps": args.accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
              "gradient_clipping": args.clip, "steps_per_print": 100,
              "zero_optimization": {"overlap_comm": not args.no_overlap},
              # The fewest live groups, two chunks gathered ahead: evicted groups are gathered again. (DeepSpeed's
              # stage3_* keys carry over only where they do not shrink ZeRO-Cache's defaults; these keys force it.)
              "zero_cache": {"enabled": True, "chunk_size": CHUNK_NUMEL, "shard_params": shard_params,
                             "gather_ahead_elements": 2 * CHUNK_NUMEL, "max_live_elements": 0,
                             "device_memory_budget": (least_working_set_budget(world_size) if args.least_working_set
                                                      else device_budget(model, world_size, args.accumulation,
                                                                         shard_params)),
                             "update_in_backward": False if args.after_backward else "auto",
                             "host_memory_budget": 64 * 2**20, "param_home": args.param_home,
                             "device_steps": (args.device_steps if args.device_steps == "auto"
                                              else int(args.device_steps))}}
    if args.nvme_path:
        config["zero_cache"]["nvme_path"] = args.nvme_path
    if args.hosts_of:
        config["zero_cache"].update(hierarchical=True, ranks_per_host=args.hosts_of)
    engine, optimizer, loader, _ = angelptm.initialize(model=model, training_data=RandomTokens(args.data_seed),
                                                       config=config)
    tiers = {group.tier for group in optimizer.store.groups}
    # Shards at home on the host (or NVMe) update there: no optimizer group on the device.
    off_device = args.param_home in ("host", "nvme")
    expected = ({"host"} if off_device else {"device", "host"}) | ({"remote"} if world_size > 1 else set())
    # (On CUDA the first plan keeps a share of the device for activations: its split differs.)
    warmup_device_groups = [group.tier for group in optimizer.store.groups].count("device")
    warmup_host_bytes = optimizer.plan.host_bytes
    if not args.warmup_least_footprint:
        assert tiers == expected or engine.device.type == "cuda", f"rank {rank}: groups in {tiers}, expected {expected}"
    # During backward (clipping included: zero_cache.optim.revision), except for ranks that accumulate micro-batches.
    assert optimizer.update_in_backward == (not args.after_backward and (args.accumulation == 1 or world_size == 1))
    # one rank streams them too
    assert optimizer.params_sharded == (shard_params or off_device)
    if off_device:
        assert set(optimizer.store.param_home) == {args.param_home}, optimizer.store.param_home
    if args.device_steps != "auto":  # every owned host group, or the count asked for
        owned = sum(group.tier == "host" for group in optimizer.store.groups)
        assert len(optimizer.device_stepped) == min(owned, int(args.device_steps)) > 0, optimizer.device_stepped
    assert optimizer.sharding.hierarchical == (bool(args.hosts_of) and world_size > 1)
    if args.least_working_set:  # each reduction waited for as soon as it is issued: no bucket held in flight
        assert optimizer.store.plan.gradient_buckets == GROUPS_IN_USE and optimizer.exchange.reduction_lag == 0
    if args.load:
        path, _ = engine.load_checkpoint(args.load)
        assert path is not None, f"no checkpoint in {args.load}"
    batches = repeat_batches(loader)
    losses = []
    for step in range(args.steps):
        if step == args.die_at_step and rank == 1:
            os._exit(3)  # a crashed rank: no cleanup, its peers are mid-collective
        loss = engine(**next(batches))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if args.warmup_least_footprint and args.steps:  # the re-plan after it placed them as the first plan does
        tiers = {group.tier for group in optimizer.store.groups}
        assert tiers == expected, f"rank {rank}: after the re-plan, groups in {tiers}, expected {expected}"
        # The warm-up moved groups off the device, as many as its host cap allows (a CPU re-plan measures no
        # activations: the settled plan is the first one, which the cap is taken against).
        settled_device_groups = [group.tier for group in optimizer.store.groups].count("device")
        assert warmup_device_groups < settled_device_groups, (rank, warmup_device_groups, settled_device_groups)
        settled_host = optimizer.plan.host_bytes
        one_group = optimizer.store.layout.chunk_numel * 12  # (a group's fp32 master and moments, at most)
        assert warmup_host_bytes <= max(int(WARMUP_HOST_FACTOR * settled_host), settled_host + one_group), \
            (rank, warmup_host_bytes, settled_host)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    if args.destroy:  # the module's own weights after destroy(), which must bring every rank's up to date itself
        engine.destroy()
        weights = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}
        assert not args.nvme_path or not open_files_under(Path(args.nvme_path)), "swap files open after destroy()"
    else:
        weights = engine.consolidated_state_dict()  # every rank: the masters are gathered
    if engine.ctx.is_main:
        gathered = optimizer.exchange.gathered if optimizer.exchange is not None else None
        torch.save({"weights": weights, "losses": losses, "global_steps": engine.global_steps,
                    "world_size": world_size, "gathers": gathered.gathers if gathered else 0,
                    "groups": optimizer.sharding.num_groups(optimizer.store.layout.num_chunks)}, args.out)
    end_job()  # destroys the process group and exits


if __name__ == "__main__":
    main()
