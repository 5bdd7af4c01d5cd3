"""``zero.GatheredParameters`` over 2 gloo ranks with ZeRO-Cache's params and masters sharded (ZeRO-3).

    torchrun --nproc-per-node 2 tests/helpers/gathered_params_job.py --seed S --out-prefix P
Both ranks train one step (half the batch each), then edit the weights inside the context: rank 1, the
modifier, with :func:`edit`, rank 0 differently (dropped). Rank r writes P.<r> with the
consolidated weights and its loss on a probe batch after the edit.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import end_job, random_batches, tiny_gpt  # noqa: E402

import angelptm  # noqa: E402

CHUNK_NUMEL = 8192
LR, BETAS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 0.1


def edit(weights: dict[str, torch.Tensor], seed: int) -> None:
    """One row of the embedding replaced, part of an MLP weight scaled (in place, as transformers does)."""
    generator = torch.Generator().manual_seed(seed)
    embedding = next(name for name in weights if "emb" in name and weights[name].dim() == 2)
    mlp = next(name for name in weights if name.endswith("weight") and weights[name].dim() == 2 and name != embedding)
    weights[embedding][5].copy_(torch.randn(weights[embedding].shape[1], generator=generator))
    weights[mlp][:3].mul_(0.5)


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    loss = model(**batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out-prefix", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    # gradient_clipping 0: torch_step, the reference, does not clip (left out, DeepSpeed's default 1.0 applies).
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False}, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS),
                                                                   "weight_decay": WEIGHT_DECAY}},
              "zero_cache": {"enabled": True, "chunk_size": CHUNK_NUMEL, "shard_params": True,
                             "device_memory_budget": "auto", "host_memory_budget": "1GiB"}}
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(args.seed, "llama"), config=config)
    assert optimizer.params_sharded and engine.zero_cache_shards == 2
    train, probe = random_batches(args.seed, count=2, batch=4)
    loss = engine(**{k: v[2 * rank:2 * rank + 2] for k, v in train.items()})
    engine.backward(loss)
    engine.step()
    params = dict(engine.module.named_parameters())
    with angelptm.zero.GatheredParameters(list(params.values()), modifier_rank=1):
        with torch.no_grad():
            if rank == 1:
                edit({name: p.data for name, p in params.items()}, args.seed)
            else:
                for p in params.values():
                    p.mul_(3.0)
    weights = engine.consolidated_state_dict()  # a collective
    with torch.no_grad():
        probe_loss = engine(**probe).item()
    torch.save({"weights": weights, "probe_loss": probe_loss}, f"{args.out_prefix}.{rank}")
    end_job()


if __name__ == "__main__":
    main()
