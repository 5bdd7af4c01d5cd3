"""A plain DeepSpeed-style script that never configures logging (or configures it as ``--logging`` says).

    python tests/helpers/plain_script_job.py --logging {none,warning,info} [--config-log-level LEVEL]

It trains a Linear for 4 steps with ``steps_per_print`` 2 and a one-stage ``PipelineModule`` for 2
``train_batch`` calls with ``steps_per_print`` 1, then prints ``LOSSES [...]`` (what ``train_batch`` returned)
so a test can match them against the loss lines the engine printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import angelptm as deepspeed  # noqa: E402
from angelptm.pipe import LayerSpec, PipelineModule  # noqa: E402

OPTIMIZER = {"type": "Adam", "params": {"lr": 0.01}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--logging", choices=("none", "warning", "info"), required=True)
    parser.add_argument("--config-log-level", help="DeepSpeed's log_level config key")
    args = parser.parse_args()
    level = {"log_level": args.config_log_level} if args.config_log_level else {}
    if args.logging != "none":
        logging.basicConfig(level=logging.WARNING if args.logging == "warning" else logging.INFO)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
        "train_batch_size": 1, "steps_per_print": 2, "optimizer": OPTIMIZER, **level})
    for _ in range(4):
        engine.backward(engine(torch.randn(1, 4)).sum())
        engine.step()
    pipe = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 8), torch.nn.Tanh(), LayerSpec(torch.nn.Linear, 8, 2)],
                          num_stages=1, loss_fn=torch.nn.functional.mse_loss)
    pipe_engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1, "optimizer": OPTIMIZER,
        **level})
    data = iter([(torch.randn(2, 4), torch.randn(2, 2)) for _ in range(4)])
    losses = [pipe_engine.train_batch(data).item() for _ in range(2)]
    print("LOSSES", json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
    from reference import end_job  # (tests/helpers: the script's own folder is on sys.path)

    end_job()  # out before interpreter teardown, where gloo's threads abort a finished job now and then
