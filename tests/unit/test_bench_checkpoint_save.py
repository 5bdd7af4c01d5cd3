"""The checkpoint-save bench (bench/checkpoint_save.py) end to end on CPU (--quick), and its arithmetic: the save's
stall over step timings, the quiet steps' baseline, the resume's verdict against the spread, the disk-space check."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from launch import load_script

ROOT = Path(__file__).resolve().parents[2]


def bench():
    return load_script("bench/checkpoint_save.py")


def test_the_quick_bench_runs_end_to_end_and_prints_every_measurement(tmp_path):
    save_dir = tmp_path / "save"
    done = subprocess.run([sys.executable, str(ROOT / "bench/checkpoint_save.py"), "--quick", "--save-dir",
                           str(save_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by_kind: dict[str, list[dict]] = {}
    for line in lines:
        by_kind.setdefault(line["measure"], []).append(line)
    assert sorted(by_kind) == ["disk", "load", "resume", "save", "summary"], sorted(by_kind)
    disk = by_kind["disk"][0]
    assert disk["write_gbps"] > 0 and disk["read_gbps"] > 0 and disk["bytes"] >= 29_000_000
    saves = by_kind["save"]
    assert [s["step"] for s in saves] == [2, 4]  # every --save-every (2) below --steps (5)
    for save in saves:
        assert 0 <= save["stall_fraction"] <= 1 and save["blocking_s"] >= 0 and save["excess_s"] >= 0
        assert save["stall_s"] == pytest.approx(save["blocking_s"] + save["excess_s"])
        assert save["stall_fraction"] == pytest.approx(save["stall_s"] / (100 * save["baseline_step_s"]))
        assert save["write_s"] > 0 and save["bytes"] > 1_000_000  # the tiny GPT's states and weights
        assert save["write_gbps"] == pytest.approx(save["bytes"] / save["write_s"] / 1e9)
        assert save["fraction_of_disk_write"] == pytest.approx(save["write_gbps"] / disk["write_gbps"])
        assert save["rss_peak_gib"] > 0.1 and save["rss_before_gib"] > 0.1
    load = by_kind["load"][0]
    assert load["bytes"] == saves[-1]["bytes"] and load["load_s"] > 0
    assert load["fraction_of_disk_read"] == pytest.approx(load["read_gbps"] / disk["read_gbps"])
    assert load["rss_load_growth_gib"] == pytest.approx(load["rss_after_load_gib"] - load["rss_before_load_gib"])
    assert load["rss_built_run_gib"] > 0.1 and load["rss_before_load_gib"] > 0.1
    resume = by_kind["resume"][0]
    assert resume["resumed_at"] == 4 and resume["steps_compared"] == 1
    assert resume["verdict"] == "bit-exact" and resume["losses_c"] == resume["losses_a"]  # CPU: deterministic
    assert all(math.isfinite(x) for x in resume["losses_a"])
    summary = by_kind["summary"][0]
    assert lines[-1] is summary
    assert summary["stall_fraction_max"] == max(s["stall_fraction"] for s in saves)
    assert summary["save_fraction_of_disk_min"] == min(s["fraction_of_disk_write"] for s in saves)
    assert summary["resume"] == "bit-exact" and summary["model"] == "tiny"
    assert not save_dir.exists() or not any(save_dir.glob("global_step*"))  # run B's start removed the checkpoint


def test_the_stall_is_the_blocking_time_plus_the_excess_of_the_steps_the_write_overlaps():
    module = bench()
    rng = random.Random()
    baseline = rng.uniform(0.5, 2.0)
    slow = [rng.uniform(0.1, 1.0) for _ in range(3)]
    clock, steps = 0.0, []
    for index in range(10):  # steps 4, 5, 6 (0-based) run beside the write and are slowed
        start = clock + (0.3 if index == 4 else 0.0)  # the save call (0.3 s) is between steps 3 and 4
        clock = start + baseline + (slow[index - 4] if 4 <= index <= 6 else 0.0)
        steps.append((start, clock))
    returned = steps[3][1] + 0.3
    done = steps[6][1] - 0.01  # the writer ends during step 6
    blocking = 0.3 + rng.uniform(0, 0.5)  # (and some wait for a previous save)
    stall = module.save_stall(steps, baseline, called=steps[3][1], returned=returned, done=done, blocking_s=blocking)
    assert stall["overlapped_steps"] == 3
    assert stall["excess_s"] == pytest.approx(sum(slow))
    assert stall["stall_s"] == pytest.approx(blocking + sum(slow))
    assert stall["stall_fraction"] == pytest.approx((blocking + sum(slow)) / (100 * baseline))
    assert stall["write_s"] == pytest.approx(done - steps[3][1])
    saves = [{"called": steps[3][1], "done": done}]
    assert module.baseline_step_s(steps, saves, warmup=1) == pytest.approx(baseline)  # the quiet steps' median
    faster = module.save_stall(steps, baseline + 5, called=steps[3][1], returned=returned, done=done,
                               blocking_s=blocking)
    assert faster["excess_s"] == 0 and faster["stall_s"] == pytest.approx(blocking)  # (never below the blocking)


@pytest.mark.parametrize("offset, verdict", [(0.0, "bit-exact"), (0.5, "within noise"), (2.0, "outside noise")])
def test_the_resume_verdict_weighs_c_against_the_spread_of_a_and_b(offset, verdict):
    module = bench()
    rng = random.Random()
    losses_a = [rng.uniform(5, 10) for _ in range(8)]
    spread = rng.uniform(1e-3, 1e-2)
    losses_b = [x + (spread if i == 6 else spread / 3) for i, x in enumerate(losses_a)]
    losses_c = [x + (offset * spread if i == 5 else 0.0) for i, x in enumerate(losses_a[4:], start=4)]
    line = module.resume_line({"losses": losses_a}, {"losses": losses_b}, {"losses": losses_c, "resumed_at": 4})
    assert line["spread_ab"] == pytest.approx(spread) and line["verdict"] == verdict
    assert line["max_diff_ca"] == pytest.approx(offset * spread)


def test_a_disk_too_small_for_a_checkpoint_stops_before_anything_runs(tmp_path, monkeypatch):
    module = bench()
    usage = module.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(module.shutil, "disk_usage", lambda path: usage._replace(free=30 * 10**9))
    with pytest.raises(SystemExit) as stopped:
        module.check_free_space(tmp_path / "save", "2.7b", 4 * 10**9)
    message = str(stopped.value)
    assert "has 30.0 GB free; a 2.7b checkpoint needs about 38.9 GB" in message and "--model (1.3b)" in message
    assert module.check_free_space(tmp_path / "save", "1.3b", 4 * 10**9) > 10**10  # 1.3B fits in 30 GB
