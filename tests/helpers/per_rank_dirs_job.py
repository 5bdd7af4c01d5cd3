"""Two ranks train and save checkpoints into different directories, as HelloDeepSpeed's per-rank timestamps do.

    torchrun --nproc-per-node 2 tests/helpers/per_rank_dirs_job.py --base D
Rank r saves into D/rank<r> twice (tags step1 and step2); rank 0 writes D/weights.pt with the weights saved last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import end_job  # noqa: E402

import angelptm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = angelptm.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    save_dir = Path(args.base) / f"rank{rank}"  # not created by anyone beforehand
    for step in (1, 2):
        loss = engine(torch.randn(2, 8, generator=generator)).square().mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(str(save_dir), tag=f"step{step}")
    if rank == 0:
        torch.save(engine.consolidated_state_dict(), Path(args.base) / "weights.pt")
    end_job()  # destroys the process group and exits


if __name__ == "__main__":
    main()
