"""DeepSpeed 0.19.8's low-precision modes under ``deepspeed`` or ``angelptm`` (only the import differs):

    python tests/helpers/bf16_modes_job.py {deepspeed,angelptm} OUT.json

For each mode in :data:`MODES` the same small MLP (LayerNorm between Linears, so autocast runs ops in both dtypes)
trains 6 steps on fresh random batches from a seeded generator; OUT.json maps each mode to its per-step losses, its
gradient norms, the dtypes of the first parameter's master and moments, and the final weights' checksum. DeepSpeed
needs a launcher's environment even for one rank (the test sets it).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}}
BF16_BOTH = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
MODES = {
    "masters_and_states_stage1": {"bf16": BF16_BOTH, "zero_optimization": {"stage": 1}},
    "masters_and_states_gas2_clip": {"bf16": BF16_BOTH, "zero_optimization": {"stage": 2},
                                     "gradient_accumulation_steps": 2, "gradient_clipping": 0.05},
    "masters_only_offload": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "default_bf16_stage1": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "autocast_bf16_stage0": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "autocast_default_stage1": {"torch_autocast": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "autocast_over_bf16_stage1": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 1}},
}
STEPS = 6


def run(deepspeed, mode: dict) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.LayerNorm(48), torch.nn.Tanh(),
                                torch.nn.Linear(48, 8))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config={**BASE, **mode})
    dtype = next(engine.module.parameters()).dtype
    generator = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS * engine.gradient_accumulation_steps()):
        x = torch.randn(4, 16, generator=generator).to(dtype)
        y = torch.randn(4, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(loss.item())
        if boundary:
            norm = engine.get_global_grad_norm()  # (None where DeepSpeed's optimizer does not keep it)
            norms.append(None if norm is None else float(norm))
    inner = getattr(optimizer, "optimizer", optimizer)  # (DeepSpeed without ZeRO returns its FusedAdam itself)
    master = inner.param_groups[0]["params"][0]
    state = inner.state[master]
    return {"losses": losses, "norms": norms, "param_dtype": str(dtype), "master_dtype": str(master.dtype),
            "state_dtypes": {key: str(state[key].dtype) for key in ("exp_avg", "exp_avg_sq")},
            "weights": sum(p.detach().double().abs().sum().item() for p in engine.module.parameters())}


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    deepspeed = importlib.import_module(backend)
    if backend == "deepspeed":  # skip its shared-memory all-reduce op (a JIT build on first use); gloo does it
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")
    Path(out).write_text(json.dumps({name: run(deepspeed, mode) for name, mode in MODES.items()}))


if __name__ == "__main__":
    main()
