"""The 4-GPU harness on 4 gloo processes: bench/moe_alltoall.py's exchange mode (2 nodes x 2 ranks)
runs the moe package's flat and hierarchical exchanges and reports identical received rows, so the
device run of bench/four_gpu.sh does not find it broken."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_ok, torchrun

BENCH = Path(__file__).resolve().parents[2] / "bench" / "moe_alltoall.py"
pytestmark = pytest.mark.dist


def test_alltoall_bench_flat_and_hierarchical_deliver_identical_rows(tmp_path):
    log = tmp_path / "moe_alltoall_2x2.log"
    run_ok(torchrun(4, BENCH, "--ranks-per-node", "2", "--max-mib", "0.25", "--iters", "2", "--hidden", "256",
                    "--log-file", str(log)), timeout=240)
    text = log.read_text()
    assert "4 ranks as 2 nodes x 2" in text
    size_rows = [line for line in text.splitlines() if line.startswith("| ") and " MiB | " in line]
    assert len(size_rows) == 2, text  # 64 KiB and 256 KiB per rank
    assert all(row.rstrip().endswith("| True |") for row in size_rows), text
    assert "identical received rows (flat vs hierarchical, every rank, every size): True" in text
