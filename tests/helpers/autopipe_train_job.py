"""Optimizer steps of ``angelptm/pretraining/pipeline_parallel.py`` for the AutoPipe training test; started by torchrun.

    torchrun --nproc-per-node W tests/helpers/autopipe_train_job.py --stages S --steps N --out PREFIX

Builds the pipeline with the functions ``pipeline.train`` uses (``check_config``, ``build_runner``,
``build_optimizer``, the replica's :class:`ResumableDataLoader`) and runs ``pipeline.train_step`` N times:
the flushes, ``reduce_and_clip`` (data-parallel mean, tied-gradient sum into the fp32 buffers, global norm,
clipping) and the AdamW update. Writes ``PREFIX.<rank>`` with this rank's fp32 masters, the pre-clip norm of
every step and, on rank 0, the mean loss of every step over the replicas.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import SEQ, VOCAB, RandomTokens, end_job  # noqa: E402

from angelptm.config import load_config  # noqa: E402
from angelptm.launch.distributed import init_distributed  # noqa: E402
from angelptm.pretraining import pipeline_parallel as pipeline  # noqa: E402
from angelptm.pretraining.data import repeat_batches  # noqa: E402
from angelptm.pretraining.data.loader import ResumableDataLoader  # noqa: E402


def config(stages: int, steps: int) -> dict:
    """fp32, dropout 0, tied embeddings, 2 flushes of 2 micro-batches per step, a clip that bites."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "gradient_clipping": 0.05,
        "seed": 7,
        "model": {"flavour": "gpt2", "vocab_size": VOCAB, "max_seq_len": SEQ, "num_layers": 2, "hidden_size": 32,
                  "num_heads": 4, "dropout": 0.0, "tie_embeddings": True},
        "data": {"shuffle": False},
        "train": {"steps": steps},
        "autopipe": {"enabled": True, "num_stages": stages, "num_microbatches": 2, "schedule": "1f1b",
                     "profile_warmup": 0, "profile_repeats": 1},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ctx = init_distributed()
    cfg = load_config(config(args.stages, args.steps), world_size=ctx.world_size)
    dataset = RandomTokens()
    layout = pipeline.check_config(cfg, ctx)
    runner, _ = pipeline.build_runner(cfg, ctx, layout, dataset)
    optimizer = pipeline.build_optimizer(cfg, runner)
    flush_size = cfg.batch.micro_batch_size * cfg.autopipe.num_microbatches  # as pipeline.train builds it
    loader = ResumableDataLoader(dataset, flush_size, rank=ctx.rank // layout.num_stages,
                                 world_size=layout.num_replicas, shuffle=cfg.data.shuffle, seed=cfg.seed)
    batches = repeat_batches(loader)
    losses, norms = [], []
    for _ in range(cfg.train.steps):
        loss, norm = pipeline.train_step(cfg, runner, optimizer, batches)
        total = loss if loss is not None else torch.zeros(())
        dist.all_reduce(total, group=ctx.group)  # only the last stage of each replica holds a loss
        losses.append(total.item() / layout.num_replicas)
        norms.append(norm)
    torch.save({"losses": losses, "norms": norms, "masters": optimizer.master_state_dict(),
                "chunks": runner.chunk_ids, "tied": runner.tied_parameter_names,
                "clip": cfg.gradient_clipping, "train_batch_size": cfg.batch.train_batch_size},
               f"{args.out}.{ctx.rank}")
    end_job()  # destroys the process group and exits


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
