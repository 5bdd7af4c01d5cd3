"""What a script does to ``.grad`` between backward calls, run under ``deepspeed`` or ``angelptm`` (issue 28).

    python tests/helpers/grad_clear_job.py --backend deepspeed --seed 7

prints one JSON object: scenario name -> the trained weights (flattened, per model), so that a test can run
the same scenarios under angelptm in its own process (:func:`run_all`) and compare. Only the import differs.
The scenarios are DeepSpeed ZeRO stage 0 with a client torch optimizer, as DeepSpeedExamples' DCGAN uses it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

OUTSIDE_FACTOR = 100.0
"""The backward outside the engine is this much larger, so whether it reached the step is plain to see."""


def _engine(deepspeed: ModuleType, model: nn.Module, optimizer: torch.optim.Optimizer, config: dict):
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                           config={"steps_per_print": 1000, **config})
    return engine


def _linear(seed: int) -> tuple[nn.Linear, torch.optim.SGD]:
    torch.manual_seed(seed)
    net = nn.Linear(4, 1)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def _issue_example(clipping: dict) -> Callable[[ModuleType, int, dict], list[float]]:
    """The issue's example, its config as written (no gradient_clipping: DeepSpeed 0.19's default 1.0 applies)
    plus ``clipping``; its gradient norm is sqrt(5), so the default clips it."""
    def scenario(deepspeed: ModuleType, seed: int, precision: dict) -> list[float]:
        net, opt = _linear(0)
        eng = _engine(deepspeed, net, opt, {"train_batch_size": 1, **clipping, **precision})
        x = torch.ones(1, 4, dtype=next(net.parameters()).dtype)
        (net(x).sum() * 100).backward()
        net.zero_grad()
        eng.backward(net(x).sum())
        eng.step()
        return net.weight.detach().float().flatten().tolist()
    return scenario


def _random_inputs(clipping: dict) -> Callable[[ModuleType, int, dict], list[float]]:
    """Two steps on fresh random inputs, large enough that the gradient norm passes 1, with the config leaving
    gradient_clipping out (DeepSpeed's default) plus ``clipping``."""
    def scenario(deepspeed: ModuleType, seed: int, precision: dict) -> list[float]:
        net, opt = _linear(seed)
        eng = _engine(deepspeed, net, opt, {"train_micro_batch_size_per_gpu": 2, **clipping, **precision})
        generator = torch.Generator().manual_seed(seed + 1)
        dtype = next(net.parameters()).dtype
        for _ in range(2):
            x = (torch.randn(2, 4, generator=generator) * 4 + 2).to(dtype)
            eng.backward(eng(x).sum())
            eng.step()
        return [v for p in net.parameters() for v in p.detach().float().flatten().tolist()]
    return scenario


def _clearing(clear: Callable[[nn.Module, torch.optim.Optimizer], None] | None, *, outside_first: bool = True,
              accumulation: int = 1) -> Callable[[ModuleType, int, dict], list[float]]:
    """A scenario: a large backward outside the engine (before or after the engine's), optionally cleared."""
    def scenario(deepspeed: ModuleType, seed: int, precision: dict) -> list[float]:
        net, opt = _linear(seed)
        eng = _engine(deepspeed, net, opt, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps":
                                            accumulation, "gradient_clipping": 0.0, **precision})
        generator = torch.Generator().manual_seed(seed + 1)
        dtype = next(net.parameters()).dtype
        xs = [torch.randn(2, 4, generator=generator).to(dtype) for _ in range(accumulation + 1)]
        if outside_first:
            (net(xs[-1]).square().sum() * OUTSIDE_FACTOR).backward()
            if clear is not None:
                clear(net, opt)
        for x in xs[:accumulation]:
            eng.backward(eng(x).square().mean())
            if not outside_first:
                (net(xs[-1]).square().sum() * OUTSIDE_FACTOR).backward()
                if clear is not None:
                    clear(net, opt)
            eng.step()
        return [v for p in net.parameters() for v in p.detach().float().flatten().tolist()]
    return scenario


def gan(deepspeed: ModuleType, seed: int, precision: dict) -> list[float]:
    """DeepSpeedExamples' DCGAN loop (training/gan/gan_deepspeed_train.py) on small MLPs: the generator's loss runs
    backward through the discriminator, whose gradients ``netD.zero_grad()`` drops at the next iteration."""
    torch.manual_seed(seed)
    net_g = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 5), nn.Tanh())
    net_d = nn.Sequential(nn.Linear(5, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-2, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-2, betas=(0.5, 0.999))
    config = {"train_batch_size": 8, "gradient_clipping": 0.0, **precision}
    engine_d, engine_g = _engine(deepspeed, net_d, opt_d, config), _engine(deepspeed, net_g, opt_g, config)
    criterion = nn.BCELoss()
    generator = torch.Generator().manual_seed(seed + 1)
    dtype = next(net_d.parameters()).dtype
    for _ in range(3):
        real = torch.randn(8, 5, generator=generator).to(dtype)
        noise = torch.randn(8, 3, generator=generator).to(dtype)
        net_d.zero_grad()
        label = torch.full((8,), 1.0, dtype=dtype)
        engine_d.backward(criterion(net_d(real).view(-1), label))
        fake = net_g(noise)
        engine_d.backward(criterion(net_d(fake.detach()).view(-1), label.fill_(0.0)))
        engine_d.step()
        net_g.zero_grad()
        engine_g.backward(criterion(net_d(fake).view(-1), label.fill_(1.0)))  # also reaches net_d's .grad
        engine_g.step()
    return [v for net in (net_d, net_g) for p in net.parameters() for v in p.detach().float().flatten().tolist()]


SCENARIOS: dict[str, Callable[[ModuleType, int, dict], list[float]]] = {
    "issue_example": _issue_example({}),
    "issue_example_unclipped": _issue_example({"gradient_clipping": 0.0}),
    "random_inputs": _random_inputs({}),
    "random_inputs_unclipped": _random_inputs({"gradient_clipping": 0.0}),
    "outside_kept": _clearing(None),
    "outside_after_kept": _clearing(None, outside_first=False),
    "module_zero_grad": _clearing(lambda net, opt: net.zero_grad()),
    "module_zero_grad_to_zeros": _clearing(lambda net, opt: net.zero_grad(set_to_none=False)),
    "client_optimizer_zero_grad": _clearing(lambda net, opt: opt.zero_grad()),
    "grad_set_to_none_by_hand": _clearing(lambda net, opt: setattr(net.weight, "grad", None)),
    "cleared_after_engine_backward": _clearing(lambda net, opt: net.zero_grad(), outside_first=False),
    "cleared_between_micro_batches": _clearing(lambda net, opt: net.zero_grad(), outside_first=False,
                                               accumulation=2),
    "dcgan": gan,
}
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}
"""fp32 is what a config without a precision section means, in DeepSpeed and here (issue 28)."""
BF16_SCENARIOS = ("issue_example", "outside_kept", "outside_after_kept", "module_zero_grad")
"""bf16 runs: where DeepSpeed's BF16 optimizer and ours agree by design (a module's zero_grad() between two
micro-batches of one window keeps what was already folded into fp32 here; DeepSpeed's stage 0 drops it)."""


def run_all(deepspeed: ModuleType, seed: int) -> dict[str, list[float]]:
    """Every scenario in fp32, and the bf16 ones, under ``deepspeed`` (the real one or angelptm)."""
    results = {f"fp32/{name}": scenario(deepspeed, seed, PRECISIONS["fp32"]) for name, scenario in SCENARIOS.items()}
    results.update({f"bf16/{name}": SCENARIOS[name](deepspeed, seed, PRECISIONS["bf16"]) for name in BF16_SCENARIOS})
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("deepspeed", "angelptm"), required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    deepspeed = importlib.import_module(args.backend)
    if args.backend == "deepspeed":  # gloo alone: skip JIT-compiling DeepSpeed's CPU shared-memory all-reduce
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    print(json.dumps(run_all(deepspeed, args.seed)))


if __name__ == "__main__":
    main()
    from reference import end_job  # (tests/helpers: the script's own folder is on sys.path)

    end_job()  # out before interpreter teardown, where gloo's threads abort a finished job now and then
