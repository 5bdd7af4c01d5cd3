"""Train a tiny GPT on real DeepSpeed or on angelptm, from scratch or resumed from a DeepSpeed checkpoint.

    torchrun --nproc-per-node W tests/helpers/ds_resume_job.py --backend {deepspeed,angelptm} --stage S \
        --save-dir DIR --first N --steps M --out RESULT.json [--load | --init-from W.safetensors] \
        [--zero-cache NAME] [--bf16]

Without ``--load``: train steps 0..N-1 and save a checkpoint into DIR. With ``--load``: build the model from another
seed (only a real load gives the right losses), ``load_checkpoint(DIR)``, then train steps N..N+M-1; with
``--init-from`` instead, load those weights into the model before ``initialize()``. Each rank draws its own batches
from a generator seeded by its rank, so step k is the same data in every run. Rank 0 writes the losses (mean over
ranks, per micro-step), the lrs, the counters and the client state to ``--out``; the DeepSpeed run that saves also
writes the fp32 weights as DeepSpeed reads them (``--out`` with ``.pt``; ZeRO stages 1-3: its own
``get_fp32_state_dict_from_zero_checkpoint``) to compare readers with.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import random_batches, tiny_gpt  # noqa: E402  (tests/helpers: the script's folder is on sys.path)

MICRO, ACCUMULATION = 4, 2
CLIENT_STATE = {"epoch": 3, "note": "from deepspeed"}


ZERO_CACHE = {"host": {"device_memory_budget": 300_000},  # most optimizer states on the host tier
              "sharded": {"shard_params": True},  # ZeRO-3's params sharded over the ranks
              "streamed": {"param_home": "host"}}  # params streamed from the host
"""ZeRO-Cache settings the resumed run may take (``--zero-cache NAME``), beside ``enabled`` and a small chunk."""


def config(stage: int, zero_cache: str | None, bf16: bool) -> dict:
    """fp32 (or bf16), AdamW with DeepSpeed's torch optimizer, a warmup still moving the lr at the resume, clipping."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
           "gradient_clipping": 0.5, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                     "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 4e-3,
                                                        "warmup_num_steps": 8, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if zero_cache:
        cfg["zero_cache"] = {"enabled": True, "chunk_size": 4096, **ZERO_CACHE[zero_cache]}
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("deepspeed", "angelptm"), required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--first", type=int, required=True, help="steps trained before the checkpoint")
    parser.add_argument("--steps", type=int, required=True, help="steps trained in this run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--zero-cache", choices=sorted(ZERO_CACHE), default=None)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--init-from", default=None, help="a safetensors file of weights to start from (no load)")
    args = parser.parse_args()
    deepspeed = importlib.import_module(args.backend)  # `import X as deepspeed`
    if args.backend == "deepspeed":  # skip its CPU shared-memory all-reduce, JIT-compiled on first use: gloo does it
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()

    resumed = args.load or args.init_from is not None
    model = tiny_gpt(seed=5 if resumed else 0)
    if args.init_from is not None:  # the way angelptm-export's hint gives to DeepSpeed: weights before initialize()
        from safetensors.torch import load_file

        model.load_state_dict(load_file(args.init_from))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config(args.stage, args.zero_cache, args.bf16))
    result: dict = {}
    if args.load:
        path, client_state = engine.load_checkpoint(args.save_dir)
        # DeepSpeed returns its own entries beside the script's (and the optimizer's state at stage 0): compared
        # are the script's keys, and whether anything else came back.
        result.update(path=None if path is None else str(path),
                      client_state={k: client_state.get(k) for k in CLIENT_STATE},
                      other_keys=sorted(set(client_state) - set(CLIENT_STATE)),
                      global_steps=engine.global_steps, global_samples=engine.global_samples,
                      skipped_steps=engine.skipped_steps)
    first = args.first if resumed else 0
    micro_batches = random_batches(1000 + rank, (first + args.steps) * ACCUMULATION, MICRO)[first * ACCUMULATION:]
    losses, lrs = [], []
    for batch in micro_batches:
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / world)
        lrs.append(engine.get_lr()[0])
    result.update(losses=losses, lrs=lrs, world_size=world)
    if not resumed:
        engine.save_checkpoint(args.save_dir, client_state=CLIENT_STATE)
    deepspeed.comm.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    if not resumed and args.backend == "deepspeed":  # the weights as DeepSpeed has them, to compare readers with
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        if args.stage > 0 and rank == 0:  # DeepSpeed's own reader of its partitions
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            read = get_fp32_state_dict_from_zero_checkpoint(args.save_dir)
            weights = {k: v.contiguous().clone() for k, v in read.items()}
        if rank == 0:
            torch.save(weights, Path(args.out).with_suffix(".pt"))
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
    from reference import end_job

    end_job()  # out before interpreter teardown, where gloo's threads abort a finished job now and then
