"""Params homed on NVMe (zero_cache.storage.param_homes.nvme.NvmeHome), one rank on CPU, fp32.

A shard at home on NVMe takes the path of one at home on the host (copied in on use, its reduced gradient
taken home over it, updated by the host's Adam) through a swap file and a few pinned buffers instead of a
pinned copy per shard: the same arithmetic on the same values, so the two runs are bitwise equal. Both
are checked against a hand-written fp32 AdamW loop too.
"""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, open_files_under, random_batches, reference_loop, train_steps

import angelptm
from angelptm.config import load_config
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.config import AioConfig
from zero_cache.plan.planner import PlanError, PlanInputs, make_plan
from zero_cache.plan.tier_names import HOST, NVME
from zero_cache.plan.units import format_bytes
from zero_cache.storage.nvme import NvmeTier
from zero_cache.storage.param_homes.nvme import NVME_HELD_GRADIENTS, NVME_STAGING_BUFFERS, NvmeHome
from zero_cache.storage.tiers import Tier, TierFullError

CHUNK_NUMEL = 8192


def tiny_gpt(seed: int, *, tied: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=4, hidden_size=32,
                                   num_heads=4, tie_embeddings=tied, activation_checkpointing=True))


def config(param_home: str, nvme_path: Path | None = None, *, clip: float = 1.0, accumulation: int = 1,
           **zero_cache) -> dict:
    zero_cache.update({"enabled": True, "chunk_size": CHUNK_NUMEL, "param_home": param_home,
                       "device_memory_budget": "auto", "host_memory_budget": "1GiB"})
    if nvme_path is not None:
        zero_cache["nvme_path"] = str(nvme_path)
    return ds_config(gradient_clipping=clip, gradient_accumulation_steps=accumulation, zero_cache=zero_cache)


@pytest.mark.parametrize("accumulation, clip, tied, in_backward", [(1, 1.0, True, "auto"), (1, 0.0, False, "auto"),
                                                                 (1, 1.0, True, False), (3, 1.0, True, "auto")])
def test_params_homed_on_nvme_train_bit_for_bit_like_params_homed_on_the_host(tmp_path, accumulation, clip, tied,
                                                                               in_backward):
    """(1, 1.0): updated during backward, clipped steps revised; (1, 0.0): untied head, nothing clipped; after
    backward: more gradients wait than buffers hold, the oldest on disk; (3, 1.0): micro-batches accumulate in
    fp32 on the host, updated after backward."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=3 * accumulation, batch=2)
    options = dict(clip=clip, accumulation=accumulation, update_in_backward=in_backward)
    host_engine, host_optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed, tied=tied),
                                                            config=config("host", **options))
    host_losses = train_steps(host_engine, batches)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed, tied=tied),
                                                  config=config("nvme", tmp_path, **options))
    store = optimizer.store
    assert store.shard_params and set(store.param_home) == {NVME} and all(s is None for s in store.shards)
    assert all(group.tier == HOST for group in store.groups)
    losses = train_steps(engine, batches)
    assert losses == host_losses
    expected = host_optimizer.master_state_dict()
    masters = optimizer.master_state_dict()
    start = dict(tiny_gpt(seed, tied=tied).named_parameters())
    assert max((expected[n] - start[n].detach()).abs().max().item() for n in expected) > 1e-3, "training must move"
    assert all(torch.equal(masters[name], value) for name, value in expected.items())
    # Host memory holds the staging buffers (a slot each, plus the slack that aligns it), not the shards.
    home: NvmeHome = store.homes[NVME]
    shards_bytes = len(store.shards) * CHUNK_NUMEL * 4
    staging_bytes = NVME_STAGING_BUFFERS * (home.disk.slot_bytes + 4096)
    assert store.tiers[HOST].used_bytes == host_optimizer.store.tiers[HOST].used_bytes - shards_bytes + staging_bytes
    report = optimizer.report()  # (the optimizer's swap file is empty: every group is on the host)
    assert report["zero_cache_nvme_bytes"] == home.disk.used_bytes == len(store.shards) * home.disk.slot_bytes
    reads, writes = report["zero_cache_nvme_read_bytes"], report["zero_cache_nvme_write_bytes"]
    assert reads >= 2 * len(batches) * len(store.shards) * home.disk.slot_bytes and writes > 0, report
    assert home.reads_ahead_used >= len(batches), "reads must start ahead along the trace"
    if in_backward is False and accumulation == 1:  # every gradient waits for step(): most of them on disk
        assert home.gradients_to_disk >= len(batches) * (len(store.shards) - NVME_HELD_GRADIENTS)
    assert not list(tmp_path.iterdir()), "swap files have no name while they are used"


def test_params_homed_on_nvme_follow_a_plain_fp32_adamw_loop(tmp_path):
    """Fresh random inputs, clipping at 1.0: the engine against torch AdamW over fp32 masters."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=5, batch=4)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=config("nvme", tmp_path))
    losses = train_steps(engine, batches)
    expected_losses, expected = reference_loop(tiny_gpt(seed), batches, dtype=torch.float32, accumulation=1,
                                               lr=3e-3, clip=1.0)
    assert expected_losses[-1] < expected_losses[0], f"the reference must learn: {expected_losses}"
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    masters = optimizer.master_state_dict()
    start = dict(tiny_gpt(seed).named_parameters())
    moved = max((value - start[name].detach()).abs().max().item() for name, value in expected.items())
    assert moved > 1e-2, f"training moved the weights by only {moved}"
    # Two Adam implementations round differently: a bias element whose gradient is rounding noise shows it at a few
    # 1e-6, a thousandth of one step's movement; a stale or lost shard would differ by whole steps (lr 3e-3).
    for name, value in expected.items():
        torch.testing.assert_close(masters[name], value, rtol=1e-4, atol=1e-5)
    # fp32 params are their masters: refreshing the masters from the shards on disk changes no bit.
    optimizer.refresh_masters_from_params()
    assert all(torch.equal(value, masters[name]) for name, value in optimizer.master_state_dict().items())


def test_deepspeeds_offload_param_nvme_permits_disk_homes_for_what_memory_cannot_hold(tmp_path):
    """A DeepSpeed ZeRO-Infinity config (params and optimizer states to NVMe) as a user has it: a permission, not a
    placement. With room for about half the shards in host memory beside the disk's staging buffers, the first ones
    the forward uses live there and the rest on the disk; it trains like plain fp32 AdamW, and a dropped engine
    leaves nothing on the disk."""
    seed = torch.randint(0, 10_000, ()).item()
    ds = ds_config(gradient_clipping=1.0, zero_optimization={
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        zero_cache={"chunk_size": 4096, "device_memory_budget": 100 * 1024, "host_memory_budget": 500 * 1024})
    parsed = load_config(ds).zero_cache
    assert parsed.enabled and parsed.param_home == "auto" and parsed.nvme_param_homes
    assert parsed.nvme_path == str(tmp_path)
    by_hand = load_config({**ds, "zero_cache": {"enabled": True}}).zero_cache  # (its path still comes along)
    assert by_hand.nvme_param_homes and by_hand.nvme_path == str(tmp_path)
    batches = random_batches(seed, count=4, batch=4)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=ds)
    homes = optimizer.store.param_home
    assert set(homes) == {HOST, NVME}, homes
    in_order = list(range(len(homes)))  # (no trace before the first step: the chunks' order)
    assert sorted(in_order, key=lambda g: homes[g] == NVME) == in_order, "the first used live in host memory"
    losses = train_steps(engine, batches)
    assert set(optimizer.store.param_home) == {HOST, NVME}  # (after the re-plan too)
    expected_losses, _ = reference_loop(tiny_gpt(seed), batches, dtype=torch.float32, accumulation=1, lr=3e-3, clip=1.0)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert open_files_under(tmp_path) >= 2, "the optimizer's swap file and the param homes'"
    optimizer.finish_pending()  # until the worker's last update ends, it holds the store
    alive = weakref.ref(optimizer)
    del engine, optimizer
    gc.collect()
    assert alive() is None
    assert open_files_under(tmp_path) == 0 and not list(tmp_path.iterdir()), "a dropped engine frees its swap files"


def test_a_run_with_params_homed_on_nvme_resumes_exactly(tmp_path):
    """Saved after 2 of 4 steps and loaded into a fresh engine (another seed's weights): the last 2 steps' losses are
    the uninterrupted run's, bit for bit; loading only the module rewrites the shards on disk from it too."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=2)
    cfg = config("nvme", tmp_path / "swap")
    (tmp_path / "swap").mkdir()
    straight, _, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=cfg)
    expected = train_steps(straight, batches)
    first, _, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=cfg)
    train_steps(first, batches[:2])
    first.save_checkpoint(tmp_path / "ckpt")
    resumed, _, _, _ = angelptm.initialize(model=tiny_gpt(seed + 1), config=cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train_steps(resumed, batches[2:]) == expected[2:]
    weights_only, _, _, _ = angelptm.initialize(model=tiny_gpt(seed + 2), config=cfg)
    weights_only.load_checkpoint(tmp_path / "ckpt", load_module_only=True)
    assert train_steps(weights_only, batches[2:3]) == expected[2:3]  # (its moments start afresh after that)


def test_params_homed_on_nvme_need_a_swap_directory(tmp_path):
    with pytest.raises(angelptm.ConfigError, match=r"param_home is \"nvme\" but no swap directory is set: set "
                                                     r"zero_cache.nvme_path"):
        angelptm.initialize(model=tiny_gpt(0), config=config("nvme"))
    with pytest.raises(angelptm.ConfigError, match=r"nvme_path: .*missing.* is not an existing directory.*mkdir -p"):
        angelptm.initialize(model=tiny_gpt(0), config=config("nvme", tmp_path / "missing"))
    no_path = ds_config(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}})
    with pytest.raises(angelptm.ConfigError, match=r"nvme_param_homes is true but no swap directory is set"):
        angelptm.initialize(model=tiny_gpt(0), config=no_path)


def test_params_homed_on_nvme_need_a_writable_swap_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):
        pytest.skip("running as a user who may write anywhere (root)")
    with pytest.raises(angelptm.ConfigError, match=r"nvme_path: .*locked.* is not writable"):
        angelptm.initialize(model=tiny_gpt(0), config=config("nvme", locked))


def nvme_inputs(**overrides) -> PlanInputs:
    """One rank, 10 chunks of 1,000 bf16 elements (2,000 B shards, 4,096 B on disk), room for 3 live groups."""
    values = dict(num_chunks=10, chunk_numel=1000, param_bytes_per_element=2, device_budget_bytes=10**6,
                  host_budget_bytes=10**6, trace=tuple(range(10)) + tuple(reversed(range(10))), margin_fraction=0.0,
                  param_chunks_held=10, param_home=NVME, live_groups=3, gather_ahead=1,
                  gradient_buckets=3, grad_bytes_per_element=0, nvme_budget_bytes=10**6,
                  nvme_path_set=True)
    values.update(overrides)
    return PlanInputs(**values)


def test_the_plan_puts_every_shard_on_disk_and_counts_its_buffers_and_traffic():
    plan = make_plan(nvme_inputs())
    assert plan.param_home == (NVME,) * 10 and plan.optimizer_tier == (HOST,) * 10 and plan.cache_slots == 3
    assert not plan.params_resident  # they stream, from the disk
    # host: the staging buffers (a 4 KiB slot each, plus alignment slack), the optimizer groups, the fp32 scratch
    assert plan.host_bytes == NVME_STAGING_BUFFERS * (4096 + 4096) + 10 * 12_000 + 4_000
    assert plan.nvme_bytes == plan.param_nvme_bytes == 10 * 4096
    # each shard read twice (forward, backward) and its new params written once; no kept gradient (none wanted): all
    # 10 gradients wait for the step, the last NVME_HELD_GRADIENTS of backward in buffers, the rest on disk and back
    spilled = 10 - NVME_HELD_GRADIENTS
    assert plan.traffic.gradients_to_disk == spilled and f"{spilled} gradients wait on disk" in plan.summary()
    assert plan.traffic.disk_bytes == (10 * 2 + 10 + 2 * spilled) * 4096 and "disk" in plan.traffic.floors
    assert plan.device_stepped == ()  # a shard on disk is updated by the host
    # A kept gradient per chunk (room for all): each is updated during backward, none waits.
    kept = make_plan(nvme_inputs(kept_bytes_per_element=2))
    assert len(kept.kept_gradients) == 10 and kept.traffic.gradients_to_disk == 0
    assert kept.traffic.disk_bytes == (10 * 2 + 10) * 4096 and "wait on disk" not in kept.summary()
    # Accumulating micro-batches: gradients go to the fp32 accumulators, never home.
    accumulating = make_plan(nvme_inputs(grad_bytes_per_element=4))
    assert accumulating.traffic.gradients_to_disk == 0 and accumulating.traffic.disk_bytes == (10 * 2 + 10) * 4096


def test_a_disk_too_small_for_the_shards_is_refused_with_the_shortfall():
    with pytest.raises(PlanError, match=r"the nvme tier needs 40.00 KiB but its budget is 20.00 KiB .*param shards"):
        make_plan(nvme_inputs(nvme_budget_bytes=20 * 1024))
    with pytest.raises(PlanError, match=r"add an NVMe tier \(zero_cache.nvme_path\)"):
        make_plan(nvme_inputs(nvme_budget_bytes=0, nvme_path_set=False))


def test_auto_homes_fill_the_host_with_shards_and_put_the_rest_on_disk_where_that_is_permitted():
    """"auto" with NVMe permitted (offload_param: nvme), 60 shards of 2,000 B: a host budget of 150,000 B holds the
    disk's staging buffers (64 KiB), the update scratch and bounce buffers, and some shards. Those the forward uses
    first live there, the rest on the disk; without the permission the plan is refused, and forcing every shard
    onto the disk moves more bytes a step."""
    inputs = nvme_inputs(num_chunks=60, param_chunks_held=60, trace=tuple(range(60)) + tuple(reversed(range(60))),
                         param_home="auto", param_homes_off_device=(HOST, NVME), host_budget_bytes=150_000,
                         device_budget_bytes=16_000, nvme_budget_bytes=10**7)
    plan = make_plan(inputs)
    on_host = plan.param_home.count(HOST)
    assert 0 < on_host < 60 and plan.param_home == (HOST,) * on_host + (NVME,) * (60 - on_host), plan.summary()
    assert plan.host_bytes <= 150_000
    # One more shard in host memory does not fit: the host holds as many as it can.
    assert plan.host_bytes + 2000 > 150_000 - 4096  # (a shard, less the alignment slack the disk's slot adds)
    # No kept gradients, none stepped on the device: every gradient waits for the step, those homed on the host in
    # host memory, those homed on the disk in its held buffers (the last NVME_HELD_GRADIENTS) or on the disk.
    assert plan.traffic.gradients_to_disk == 60 - on_host - NVME_HELD_GRADIENTS
    all_on_disk = make_plan(replace(inputs, param_home=NVME))
    assert plan.traffic.disk_bytes < all_on_disk.traffic.disk_bytes
    assert plan.traffic.seconds < all_on_disk.traffic.seconds
    with pytest.raises(PlanError, match="host tier needs"):
        make_plan(replace(inputs, param_homes_off_device=(HOST,)))


def test_a_home_given_more_shards_than_it_was_made_for_takes_them_from_the_disk_tiers_budget(tmp_path):
    """A re-plan may home more shards on the disk than the first plan made the home for: each further slot comes
    out of the NVMe tier's budget (the disk's total stays the budget the plan was made with), and a slot the
    budget has no room for is refused."""
    host = Tier(HOST, torch.device("cpu"), 2**20)
    disk = NvmeTier(tmp_path, 12 * 4096, 3 * 12 * 4096, AioConfig())
    home = NvmeHome({HOST: host, NVME: disk}, 1000, torch.float32, num_shards=1)
    whole = disk.budget_bytes + disk.split_bytes
    values = {group: torch.randn(1000) for group in range(3)}
    for group, value in values.items():  # 4 KiB slots: the first was planned, two more fit the tier's budget
        home.allocate(group)
        with home.open(group, None, fresh=True, write_back=True) as shard:
            shard.copy_(value)
    assert home.disk.used_bytes == 3 * home.disk.slot_bytes and disk.budget_bytes + disk.split_bytes == whole
    for group, value in values.items():
        with home.open(group, None) as shard:
            assert torch.equal(shard, value)
    for extra in range(disk.free_bytes // home.disk.slot_bytes):
        home.allocate(len(values) + extra)
    with pytest.raises(TierFullError, match="swap for param homes exceeds its budget"):
        home.allocate(-1)
    home.close()
    disk.close()


def test_the_plan_report_prices_the_disk_once_at_the_plans_rate():
    """`pretrain.py --plan`'s NVMe floor is the plan's: its disk bytes (optimizer groups read and written once, param
    shards per gather and update) at the plan's disk rate, the optimizer groups not counted twice."""
    from angelptm.memory.plan_report import _step_floors

    plan = make_plan(nvme_inputs(host_budget_bytes=NvmeHome.host_bytes(10, 2000) + 4000 + 3 * 12_288 + 5 * 12_000))
    groups_on_disk = plan.optimizer_tier.count(NVME)
    assert groups_on_disk and NVME in plan.param_home
    lines = _step_floors(plan, None, 1024, 400.0)
    nvme = next(line for line in lines if line.strip().startswith("NVMe"))
    seconds = plan.traffic.disk_bytes / plan.traffic.rates.disk_bytes_per_s
    assert f"{seconds * 1e3:.2f} ms" in nvme, (nvme, seconds)
    assert plan.traffic.floors["disk"] == seconds
    states = 2 * groups_on_disk * plan_slot(plan)
    assert f"({format_bytes(states)} of optimizer states, {format_bytes(plan.traffic.disk_bytes - states)} of param " \
           "shards)" in nvme, nvme


def plan_slot(plan) -> int:
    """One optimizer group's slot on disk in a plan: its share of the plan's NVMe bytes beside the shards."""
    return (plan.nvme_bytes - plan.param_nvme_bytes) // plan.optimizer_tier.count(NVME)


def test_a_home_left_without_shards_gives_its_pinned_buffers_back(tmp_path):
    """A re-plan that takes every shard off the disk trims the home: its staging buffers go back to the host tier and
    no reference to them is left (a buffer stays pinned while any view of it lives), and a shard homed here again
    makes them anew, as many as before."""
    host = Tier(HOST, torch.device("cpu"), 2**22)
    disk = NvmeTier(tmp_path, 12 * 4096, 3 * 12 * 4096, AioConfig())
    home = NvmeHome({HOST: host, NVME: disk}, 1000, torch.float32, num_shards=1)
    idle = host.used_bytes

    def train_a_shard(group: int) -> None:
        value = torch.randn(1000)
        home.allocate(group)
        with home.open(group, None, fresh=True, write_back=True) as shard:
            shard.copy_(value)
        with home.open(group, None) as shard:
            assert torch.equal(shard, value)

    train_a_shard(0)
    staged = host.used_bytes - idle
    assert staged > 0 and home._raw, "the home staged its shard through pinned buffers"
    buffers = [weakref.ref(raw) for raw in home._raw.values()]
    home.free(0, None)
    home.trim()
    assert host.used_bytes == idle
    assert not home._raw and all(buffer() is None for buffer in buffers), "a trimmed buffer is still referenced"
    train_a_shard(1)
    assert host.used_bytes - idle == staged
    home.close()
    disk.close()
