"""Data-parallel training job for the multi-process tests; started by torchrun or as a plain script.

    torchrun --nproc-per-node 2 tests/helpers/dp_job.py --micro 2 --data-seed S --out FILE
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import SEQ, VOCAB, RandomTokens, end_job  # noqa: E402

import angelptm  # noqa: E402
from angelptm.pretraining.data import repeat_batches  # noqa: E402
from angelptm.pretraining.models import ModelConfig, build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--data-seed", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # Rank 0 (and the single-process run) start from seed 0; other ranks start from different
    # weights on purpose: initialize() must broadcast rank 0's.
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    model = build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=2,
                                    hidden_size=32, num_heads=4))
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
              "gradient_clipping": 1.0, "zero_optimization": {"reduce_bucket_size": 1000}, "steps_per_print": 100}
    engine, optimizer, loader, _ = angelptm.initialize(model=model, training_data=RandomTokens(args.data_seed),
                                                       config=config)
    batches = repeat_batches(loader)
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        engine.backward(engine(**next(batches)))
        engine.step()
    if engine.ctx.is_main:
        torch.save({"masters": optimizer.master_state_dict(), "world_size": engine.world_size,
                    "steps": engine.global_steps}, args.out)
    end_job()  # destroys the process group and exits


if __name__ == "__main__":
    main()
