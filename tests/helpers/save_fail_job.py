"""Two ranks save a good checkpoint, then one fails saving the next one.

    torchrun --nproc-per-node 2 tests/helpers/save_fail_job.py --save-dir D --out-prefix P [--failing WHAT]
WHAT: "rank-file" (rank 1 cannot write its file) or "finalize" (rank 0 cannot write the manifest, after
every file was written). Each rank writes P.<rank> with the exception type it saw (or "none").
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
from angelptm.checkpoints import files as checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out-prefix", required=True)
    parser.add_argument("--failing", choices=("rank-file", "finalize"), default="rank-file")
    args = parser.parse_args()
    model = torch.nn.Linear(4, 4)
    engine, *_ = angelptm.initialize(model=model, config={"train_batch_size": 2, "optimizer": {"type": "AdamW"}})
    engine.save_checkpoint(args.save_dir, tag="good")
    rank = int(os.environ["RANK"])
    if rank == 0 and args.failing == "finalize":
        def disk_full(*_):
            raise OSError(28, "No space left on device")

        checkpoint._finalize = disk_full
    if rank == 1 and args.failing == "rank-file":
        real = checkpoint.write_file_durably

        def fail_on_rank_file(obj, path):
            if path.name == checkpoint.rank_file(1):
                raise OSError(28, "No space left on device")
            real(obj, path)

        checkpoint.write_file_durably = fail_on_rank_file
    outcome = "none"
    try:
        engine.save_checkpoint(args.save_dir, tag="bad")
    except Exception as err:  # the test inspects which error each rank saw
        outcome = f"{type(err).__name__}: {err}"
    Path(f"{args.out_prefix}.{rank}").write_text(outcome)
    end_job()  # destroys the process group and exits


if __name__ == "__main__":
    main()
