"""One rank of a 2-rank gloo job run through pretrain.main whose training is a single all_reduce that rank 1 joins
late (it sleeps, alive and beating): rank 0's collective times out after comms.timeout_s. Also reports whether
initialize()'s second init_distributed() said that comms.timeout_s does not apply, and whether it kept one heartbeat.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python comms_timeout_job.py CONFIG SLEEP_S
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pretrain  # noqa: E402
from angelptm.launch.distributed import init_distributed  # noqa: E402


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> int:
    config, sleep_s = sys.argv[1], float(sys.argv[2])
    lines = Lines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.INFO)  # (basicConfig in main does nothing once a handler is there)

    def one_collective(cfg, ctx, *args):
        again = init_distributed(timeout_s=cfg.comms.timeout_s, lost_rank_after_s=cfg.comms.lost_rank_after_s)
        print(f"same heartbeat: {again.watchdog is ctx.watchdog and ctx.watchdog is not None}", flush=True)
        print(f"said it does not apply: {any('does not apply' in line for line in lines.lines)}", flush=True)
        if ctx.rank == 1:
            time.sleep(sleep_s)
        dist.all_reduce(torch.ones(1), group=ctx.group)
        return None  # (what _train returns for a run with nothing to train)

    pretrain._train = one_collective
    return pretrain.main(["--config", config])


if __name__ == "__main__":
    sys.exit(main())
