"""A training script in the style of DeepSpeed's examples, run once under ``deepspeed`` and once under ``angelptm``.

    torchrun --nproc-per-node 2 tests/helpers/ds_script_job.py --backend {deepspeed,angelptm} \
        --deepspeed_config CONFIG.json --out RESULT.json --save-dir DIR

Only the import differs between the two runs. The script uses what DeepSpeed's examples use:
argparse with ``add_config_arguments``, ``init_distributed``, ``deepspeed.comm`` (rank, world size,
all_reduce, barrier), ``get_accelerator().device_name()``, ``initialize(args=...)``, a transformers LR
schedule built on ``engine.optimizer`` and stepped by the script, ``zero_optimization_stage()`` and
``save_16bit_model``. Rank 0 writes every micro-step's loss (mean over ranks) and lr to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
from transformers import get_linear_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STEPS = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("deepspeed", "angelptm"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed = importlib.import_module(parser.parse_known_args()[0].backend)  # `import X as deepspeed`
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    if args.backend == "deepspeed":  # skip its CPU shared-memory all-reduce, JIT-compiled on first use (40 s on
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a fresh cache): gloo adds the same
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    check = torch.tensor([float(rank + 1)])
    deepspeed.comm.all_reduce(check)
    assert check.item() == world * (world + 1) / 2, check
    device = deepspeed.accelerator.get_accelerator().device_name()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 8))
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    scheduler = get_linear_schedule_with_warmup(engine.optimizer, num_warmup_steps=2, num_training_steps=10)

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    losses, lrs = [], []
    for _ in range(STEPS * engine.gradient_accumulation_steps()):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 16, generator=generator).to(device)
        y = torch.randn(engine.train_micro_batch_size_per_gpu(), 8, generator=generator).to(device)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            scheduler.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / world)
        lrs.append(optimizer.param_groups[0]["lr"])
    deepspeed.comm.barrier()
    engine.save_16bit_model(args.save_dir, "model.bin")
    if rank == 0:
        is_torch = isinstance(engine.optimizer, torch.optim.Optimizer)
        # The group existed before initialize() (init_distributed above): comms' heartbeat must still run.
        heartbeat = getattr(getattr(engine, "ctx", None), "watchdog", None) is not None
        Path(args.out).write_text(json.dumps({"losses": losses, "lrs": lrs, "stage": engine.zero_optimization_stage(),
                                              "optimizer_is_torch": is_torch, "heartbeat": heartbeat}))
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
    from reference import end_job  # (tests/helpers: the script's own folder is on sys.path)

    end_job()  # out before interpreter teardown, where gloo's threads abort a finished job now and then
