"""GPT-MoE trained through the engine with experts spread over ranks (or in one process, as the reference).

    torchrun --nproc-per-node 2 tests/helpers/moe_engine_job.py --ep-size 2 --out PREFIX --save-dir DIR
    python tests/helpers/moe_engine_job.py --ep-size 1 --out PREFIX
    torchrun --nproc-per-node 2 tests/helpers/moe_engine_job.py --ep-size 2 --save-without-optimizer DIR

Every weight is drawn from a generator seeded by its name, experts as the whole [E, ...] tensor of
which a rank keeps its slice, so the expert-parallel model and the one-process model start equal.
Rank r trains on rows [r m, (r + 1) m) of each global batch; the reference on all of them. The
expert-parallel run also saves after step 2, resumes in a fresh engine and checks that its step 3
equals the straight run's. Writes ``PREFIX.<rank>.pt``: losses and fp32 masters.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import angelptm  # noqa: E402
from angelptm.pretraining.models import ModelConfig, build_model  # noqa: E402
from moe import MoEConfig  # noqa: E402
from moe.layer import MoELayer  # noqa: E402

SEQ, VOCAB, EXPERTS, MICRO, STEPS = 16, 64, 4, 2, 3
GLOBAL_BATCH = 4


def build(ep_size: int, ep_rank: int) -> torch.nn.Module:
    # Dropless routing and no router losses: per-rank capacity and balance statistics are not those
    # of the whole batch, and the comparison with one process must be exact.
    moe = MoEConfig(enabled=True, num_experts=EXPERTS, top_k=2, ep_size=ep_size, drop_tokens=False,
                    aux_loss_coef=0.0, z_loss_coef=0.0, moe_every=2)
    model = build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=2,
                                    hidden_size=32, num_heads=4, dropout=0.0), moe=moe)
    experts = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            if id(param) in experts:  # the global [E, ...] tensor, of which this rank holds its slice
                local = param.shape[0]
                full = torch.randn((local * ep_size, *param.shape[1:]), generator=generator) * 0.5
                param.copy_(full[ep_rank * local:(ep_rank + 1) * local])
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def batches(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Random starts continued by a fixed bigram rule: tokens a model learns within a few steps."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        for t in range(1, SEQ + 1):
            ids[:, t] = (ids[:, t - 1] * 5 + 3) % VOCAB
        per_rank = GLOBAL_BATCH // world
        rows = ids[rank * per_rank:(rank + 1) * per_rank]
        out.append({"input_ids": rows[:, :-1], "labels": rows[:, 1:]})
    return out


def engine_for(ep_size: int, rank: int, world: int):
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "weight_decay": 0.1}},
              "gradient_clipping": 0.05, "steps_per_print": 1000}
    model = build(ep_size, rank % ep_size)
    if rank >= ep_size:  # a replica starts elsewhere: initialize() must copy rank 0's dense weights and the
        with torch.no_grad():  # experts of its expert-data-parallel source (rank % ep_size)
            for param in model.parameters():
                param.add_(1.0)
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config)
    return engine, optimizer


def step(engine, batch) -> float:
    loss = engine(**batch)
    engine.backward(loss)
    engine.step()
    return float(loss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep-size", type=int, required=True)
    parser.add_argument("--out")
    parser.add_argument("--save-dir")
    parser.add_argument("--save-without-optimizer", help="save the untrained model of an engine without optimizer")
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.save_without_optimizer:
        engine, _, _, _ = angelptm.initialize(model=build(args.ep_size, rank % args.ep_size),
                                              config={"train_micro_batch_size_per_gpu": MICRO})
        engine.save_checkpoint(args.save_without_optimizer, tag="untrained")
        return
    engine, optimizer = engine_for(args.ep_size, rank, world)
    data = batches(rank, world)
    losses, norms = [], []
    for index, batch in enumerate(data):
        losses.append(step(engine, batch))
        norms.append(engine.get_global_grad_norm())
        if index == STEPS - 2 and args.save_dir:
            engine.save_checkpoint(args.save_dir, tag="resume")
            saved_masters = optimizer.master_state_dict()
    result = {"losses": losses, "norms": norms, "masters": optimizer.master_state_dict()}
    if args.save_dir:
        resumed, resumed_optimizer = engine_for(args.ep_size, rank, world)
        resumed.load_checkpoint(args.save_dir, tag="resume")
        result["resumed_loss"] = step(resumed, data[-1])
        result["resumed_masters"] = resumed_optimizer.master_state_dict()
        result["saved_masters"] = saved_masters
    torch.save(result, f"{args.out}.{rank}.pt")


if __name__ == "__main__":
    main()
    from reference import end_job  # (tests/helpers: the script's own folder is on sys.path)

    end_job()  # out before interpreter teardown, where gloo's threads abort a finished job now and then
