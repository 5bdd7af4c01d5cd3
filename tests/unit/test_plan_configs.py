"""Every shipped config is planned against the hardware it is meant for, without that hardware (issue 18).

The real-size configs (GPT 1.3B, Llama 7B/13B/30B) go through ``pretrain.py --plan``'s planning for three
machines, each with and without an NVMe tier; where a combination is meant not to fit, the refusal must
name the tier and the shortfall. docs/zero-cache.md's "Configs for real sizes" table states the same matrix with
the figures ``--plan`` prints (written by ``tools/plan_table.py``), checked here against a fresh run.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

import pytest
import torch
from launch import load_script

import zero_cache
from angelptm.config import load_config
from angelptm.memory.plan_report import PlanRequest, named_hardware, plan_report

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import pretrain  # noqa: E402

# name: (--gpus, --device-memory, --host-memory, --nvme)
HARDWARE = {
    "1x24GB": (1, "24GiB", "128GiB", "2TB"),   # a workstation card (RTX 4090 / A10 class)
    "1x80GB": (1, "80GiB", "256GiB", "4TB"),   # one A100/H100 80GB
    "8x80GB": (8, "80GiB", "1TiB", "8TB"),     # an 8-GPU server (cloud p4de/p5 class; a DGX has 2 TiB)
}
REAL_SIZES = ("gpt_1.3b", "llama_7b", "llama_13b", "llama_30b")
# (config, hardware, with NVMe) -> the tier the refusal names; every combination not listed must fit.
DOES_NOT_FIT = {
    ("llama_13b", "1x24GB", False): "host",
    ("llama_30b", "1x24GB", False): "host",
    ("llama_30b", "1x80GB", False): "host",
}
MEASURED_HERE = {"tiny": 1, "tiny_autopipe": 2, "tiny_moe": 1, "tiny_zero_cache": 1}
"""Small configs, meant for this machine (with this many ranks): planned with its measured budgets."""


def hardware(name: str, nvme: bool) -> zero_cache.Hardware:
    gpus, device, host, disk = HARDWARE[name]
    return named_hardware(gpus=gpus, device_memory=device, host_memory=host, nvme=disk if nvme else None)


def test_every_shipped_config_has_a_plan_check():
    shipped = {path.stem for path in (ROOT / "configs").glob("*.json")}
    assert shipped == set(REAL_SIZES) | set(MEASURED_HERE), "add a new config to this test's tables"


@pytest.mark.parametrize("name", REAL_SIZES)
def test_real_size_config_plans_on_the_hardware_it_is_for(name):
    cfg = load_config(ROOT / "configs" / f"{name}.json", device_type="cuda")
    for machine in HARDWARE:
        for nvme in (False, True):
            box = hardware(machine, nvme)
            text, fits = plan_report(cfg, PlanRequest(ranks=box.gpus_per_host, hardware=box))
            tier = DOES_NOT_FIT.get((name, machine, nvme))
            where = f"{name} on {machine}{' + NVMe' if nvme else ''}"
            if tier is None:
                assert fits, f"{where} was meant to fit:\n{text}"
                assert "bound: " in text and "\ndevice " in text and "\nhost " in text, text
            else:
                assert not fits, f"{where} was meant not to fit:\n{text}"
                assert f"the {tier} tier needs" in text and "short by" in text, text


@pytest.mark.parametrize("name, ranks", MEASURED_HERE.items())
def test_small_config_plans_on_this_machine(name, ranks, capsys):
    assert pretrain.main(["--config", str(ROOT / "configs" / f"{name}.json"), "--plan", "--ranks", str(ranks)]) == 0
    assert "model " in capsys.readouterr().out


def test_plan_table_for_named_hardware(capsys):
    code = pretrain.main(["--config", str(ROOT / "configs" / "llama_7b.json"), "--plan", "--gpus", "1",
                          "--device-memory", "24GiB", "--host-memory", "128GiB"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "named: 1 x GPU 24.00 GiB per host, host RAM 128.00 GiB, no NVMe; 1 rank" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("tier "))
    assert "budget/rank" in header and "planned" in header and "optimizer groups" in header
    device = next(line for line in lines if line.startswith("device "))
    assert "23.00 GiB" in device  # 24 GiB less the "auto" margin (3%, at least 1 GiB)
    assert "streamed in on use" in next(line for line in lines if line.startswith("host "))
    # 7B's optimizer groups are on the host of one 24 GB card; the GPU's Adam takes some of them after backward,
    # as many as lower the step's floor, which then lies between host Adam and PCIe
    host = next(line for line in lines if line.startswith("host "))
    assert "(host Adam; " in host and " by GPU Adam after backward)" in host, host
    assert "bound: H2D" in out or "bound: D2H" in out or "bound: host Adam" in out
    # the host bytes per parameter, in the plan and at the warm-up (capped at WARMUP_HOST_FACTOR of the plan's)
    use = next(line for line in lines if line.startswith("host use "))
    found = re.fullmatch(r"host use  ([\d.]+) GiB \(([\d.]+) B/param\) in the plan, ([\d.]+) GiB \(([\d.]+) "
                         r"B/param\) at the warm-up", use)
    assert found is not None, use
    planned, planned_per_param, warmup, warmup_per_param = map(float, found.groups())
    assert f"{planned:.2f} GiB" in host, (use, host)
    params = float(re.search(r"model     llama, ([\d.]+) G parameters", out).group(1)) * 1e9
    assert planned_per_param == pytest.approx(planned * 2**30 / params, abs=0.06)
    assert warmup_per_param == pytest.approx(warmup * 2**30 / params, abs=0.06)
    assert planned < warmup <= 1.1 * planned + 0.01


def test_named_hardware_needs_device_and_host_memory(capsys):
    assert pretrain.main(["--config", str(ROOT / "configs" / "llama_7b.json"), "--plan", "--gpus", "8",
                          "--device-memory", "80GiB"]) == 2
    assert "needs both --device-memory" in capsys.readouterr().err
    assert pretrain.main(["--config", str(ROOT / "configs" / "llama_7b.json"), "--plan",
                          "--device-memory", "80 gigs", "--host-memory", "1TiB"]) == 2
    assert "--device-memory" in capsys.readouterr().err


def test_named_budgets_split_the_host_between_its_gpus():
    config = zero_cache.ZeroCacheConfig(enabled=True)
    box = zero_cache.Hardware(device_bytes=80 * 2**30, host_bytes=1024 * 2**30, gpus_per_host=8,
                              nvme_bytes=8 * 10**12)
    budgets = zero_cache.tier_budgets(config, torch.device("cuda"), 8, box)  # only the device's type is read
    assert budgets.device_bytes == int(80 * 2**30 * 0.97)
    assert budgets.host_bytes == int(1024 * 2**30 * 0.9) // 8
    assert budgets.nvme_bytes == int(8 * 10**12 * 0.98) // 8
    explicit = zero_cache.ZeroCacheConfig(enabled=True, device_memory_budget="40GiB", host_memory_budget="64GiB")
    pinned = zero_cache.tier_budgets(explicit, torch.device("cuda"), 8, box)
    assert (pinned.device_bytes, pinned.host_bytes) == (40 * 2**30, 64 * 2**30)  # the config's bytes win



def _table_tool():
    return load_script("tools/plan_table.py")


def test_the_pages_plan_table_and_example_plan_are_what_plan_prints():
    """Every cell of docs/zero-cache.md's table (the bound's stream and time, or the refused tier's shortfall) and
    its full example plan, from ``pretrain.py --plan`` run now for the configs and machines the table names."""
    tool = _table_tool()
    assert tool.CONFIGS == REAL_SIZES and list(tool.MACHINES) == list(HARDWARE.values()), "one matrix, not two"
    page = tool.PAGE.read_text()
    fresh = tool.render(page)
    stale = [line for line in difflib.unified_diff(page.splitlines(), fresh.splitlines(), "page", "--plan now",
                                                   lineterm="", n=0)]
    assert not stale, f"docs/zero-cache.md disagrees with --plan; run `{tool.REGENERATE}`:\n" + "\n".join(stale)
