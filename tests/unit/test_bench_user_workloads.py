"""The users' workloads bench (bench/user_workloads.py) on CPU at its tiny size: the harness the BENCHMARKS.md
tables come from runs a user's script on a DeepSpeed NVMe JSON and reports its disk bytes; between runs it
removes what a run left in the swap directories (a run ends with os._exit: DeepSpeed's swap files stay)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def user_workloads():
    spec = importlib.util.spec_from_file_location("user_workloads", ROOT / "bench/user_workloads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_nvme_json_runs_and_reports_disk_bytes(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / "a_file_of_someone_else").write_text("kept")
    nvme_paths = [f"--set=zero_optimization.{offload}.nvme_path={swap}" for offload in ("offload_param",
                                                                                       "offload_optimizer")]
    done = subprocess.run([sys.executable, str(ROOT / "bench/user_workloads.py"), "--sizes", "tiny", "--engines",
                           "angelptm", "--anchor", "angelptm", "--steps", "3", "--tuning-steps", "0", "--configs",
                           str(ROOT / "bench/configs/zero_infinity_nvme.json"), *nvme_paths],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    header, _, row = done.stdout.strip().splitlines()[-3:]
    assert "disk read / written GiB per step" in header
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:4] == ["nngpt", "tiny", "zero_infinity_nvme", "angelptm"] and cells[8] == "1.00x"
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert cells[-1] == f"{result['disk_read_gib']:.2f} / {result['disk_written_gib']:.2f}"  # the steps' mean
    assert "step 2" in done.stdout and "disk read" in done.stdout  # each step's line
    assert sorted(p.name for p in swap.iterdir()) == ["a_file_of_someone_else"]


def test_what_a_run_leaves_in_the_swap_directories_of_its_edited_config_is_removed(tmp_path):
    bench = user_workloads()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for directory in (ours, theirs):
        directory.mkdir()
        (directory / "there_before").write_text("kept")
    config_path = tmp_path / "config.json"
    config_path.write_text((ROOT / "bench/configs/zero_infinity_nvme.json").read_text())
    config = bench.edited_config(str(config_path), [f"zero_optimization.offload_param.nvme_path={ours}",
                                                    f"deepspeed:zero_optimization.offload_optimizer.nvme_path={theirs}",
                                                    "angelptm:zero_cache.host_memory_budget=32GiB"], "deepspeed")
    assert "zero_cache" not in config  # another engine's edit
    dirs = bench.swap_dirs(config)
    assert dirs == {ours, theirs}
    before = bench.entries(dirs)
    (ours / "zero_stage_3").mkdir()
    (ours / "zero_stage_3" / "params.swp").write_bytes(b"x" * 4096)
    (theirs / "optimizer.swp").write_bytes(b"x" * 4096)
    bench.remove_new_entries(dirs, before)
    assert [sorted(p.name for p in d.iterdir()) for d in (ours, theirs)] == [["there_before"], ["there_before"]]
