"""A 2-stage ``PipelineModule`` script in the style of DeepSpeed's pipeline example, under either backend.

    torchrun --nproc-per-node 2 tests/helpers/ds_pipe_job.py --backend {deepspeed,angelptm} \
        --method {parameters,uniform,type:Linear,autopipe} [--seed-layers] --out RESULT.json

Layers: a tied input projection (``TiedLayerSpec``), ``LayerSpec`` linears, module and function layers,
and the tied projection again as the output (``forward_fn``), so the tied weight's gradient is summed
over both stages. ``engine.train_batch(data_iter)`` runs STEPS optimizer steps of 4 micro-batches, then
``eval_batch`` once; rank 0 writes the losses (the mean over micro-batches, returned on every rank).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STEPS, MICRO, DIM = 4, 4, 8


def transposed(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The tied projection used backwards (an output head sharing the input projection's weight)."""
    return F.linear(x, module.weight.t())


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("deepspeed", "angelptm"), required=True)
    parser.add_argument("--method", default="parameters")
    parser.add_argument("--seed-layers", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume-at", type=int, help="also: save at this step, load into a fresh pipeline, go on")
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed = importlib.import_module(parser.parse_known_args()[0].backend)
    args = deepspeed.add_config_arguments(parser).parse_args()
    if args.backend == "deepspeed":  # skip its CPU shared-memory all-reduce, JIT-compiled on first use (40 s on
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a fresh cache): gloo adds the same
    deepspeed.init_distributed(dist_backend="gloo")
    engine, data = build(deepspeed, args, seed=0)
    batches = iter(data)
    losses = [engine.train_batch(batches).item() for _ in range(STEPS)]
    evaluation = engine.eval_batch(iter(data)).item()
    result = {"losses": losses, "eval": evaluation}
    if args.resume_at is not None:  # the same steps, interrupted: save, then load into weights built otherwise
        checkpoints = Path(args.out).with_suffix(".checkpoints")
        engine, data = build(deepspeed, args, seed=0)
        batches = iter(data)
        resumed = [engine.train_batch(batches).item() for _ in range(args.resume_at)]
        engine.save_checkpoint(str(checkpoints), client_state={"step": args.resume_at})
        engine, _ = build(deepspeed, args, seed=2)
        _, client_state = engine.load_checkpoint(str(checkpoints))
        resumed += [engine.train_batch(batches).item() for _ in range(STEPS - args.resume_at)]
        result.update(resumed=resumed, client_state=client_state)
    if deepspeed.comm.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    deepspeed.comm.barrier()


def build(deepspeed, args, seed: int):
    """The pipeline (its layers built after ``torch.manual_seed(seed)``), its engine, and the data (always the same)."""
    pipe = deepspeed.pipe
    torch.manual_seed(seed)
    layers = [pipe.TiedLayerSpec("proj", nn.Linear, DIM, DIM, bias=False), nn.Tanh(),
              pipe.LayerSpec(nn.Linear, DIM, 32), nn.ReLU(), pipe.LayerSpec(nn.Linear, 32, 32), double,
              pipe.LayerSpec(nn.Linear, 32, DIM), pipe.TiedLayerSpec("proj", nn.Linear, DIM, DIM, bias=False,
                                                                     forward_fn=transposed)]
    net = pipe.PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method=args.method,
                              seed_layers=args.seed_layers, activation_checkpoint_interval=1)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 4, "steps_per_print": 1000,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}}
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(MICRO, DIM, generator=generator), torch.randn(MICRO, DIM, generator=generator))
            for _ in range(4 * STEPS)]
    # "autopipe" profiles a micro-batch at initialize(): it takes one from training_data (samples, not batches).
    samples = [(x[i], y[i]) for x, y in data for i in range(MICRO)] if args.method == "autopipe" else None
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, config=config, training_data=samples,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    return engine, data


if __name__ == "__main__":
    main()
    from reference import end_job  # (tests/helpers: the script's own folder is on sys.path)

    end_job()  # out before interpreter teardown, where gloo's threads abort a finished job now and then
