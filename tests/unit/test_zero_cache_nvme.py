"""The NVMe tier on CPU: every IO backend available here, placement, training on disk, errors, resume."""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import re
import signal
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, reference_loop, train_steps
from zero_cache_setup import CHUNK_NUMEL, budgets, six_layer_llama, zero_cache_config

import angelptm
from angelptm.pretraining.models import ModelConfig, build_model
from angelptm.telemetry.monitor import format_tiers
from zero_cache.config import AioConfig
from zero_cache.plan.layout import pack
from zero_cache.plan.planner import DEVICE, HOST, NVME
from zero_cache.storage.aio import NativeFileIO, ThreadFileIO, open_file_io
from zero_cache.storage.nvme import ALIGN_BYTES, SWAP_PREFIX, NvmeTier, check_directory

BACKENDS = ("native", "deepspeed", "libaio", "threads")


def aligned_bytes(num_bytes: int) -> torch.Tensor:
    raw = torch.empty(num_bytes + ALIGN_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN_BYTES
    return raw[start:start + num_bytes]


def backend_or_skip(name: str, **settings):
    config = AioConfig(backend=name, **settings)
    try:
        return open_file_io(config, direct=True)
    except Exception as err:  # not every backend builds on every machine; CI has native and threads
        if name in ("native", "threads"):
            raise
        pytest.skip(f"{name} backend unavailable here: {err}")


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_writes_and_reads_back_many_requests_in_flight(name, tmp_path):
    io = backend_or_skip(name, block_size=8192, queue_depth=4)
    path = tmp_path / "data.swap"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    try:
        # Sizes that are not multiples of the block size, at offsets out of order, all in flight at once.
        sizes = [ALIGN_BYTES * k for k in (1, 3, 7, 2, 5, 11)]
        placement = torch.randperm(len(sizes)).tolist()  # the file order of the buffers
        offsets = [sum(sizes[j] for j in placement[:placement.index(i)]) for i in range(len(sizes))]
        written = [aligned_bytes(n) for n in sizes]
        for buffer in written:
            buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8))
        for request in [io.submit(path, fd, b, o, write=True) for b, o in zip(written, offsets)]:
            request.wait()
        read = [aligned_bytes(n) for n in sizes]
        requests = [io.submit(path, fd, b, o, write=False) for b, o in zip(read, offsets)]
        for request in requests:
            request.wait()
            assert request.done()
        for expected, got in zip(written, read):
            assert torch.equal(expected, got)
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["native", "threads"])
def test_buffered_files_take_unaligned_sizes_and_offsets(name, tmp_path):
    """Without O_DIRECT (a filesystem that refuses it) nothing needs to be block-aligned."""
    io = backend_or_skip(name, block_size=4096, queue_depth=3)
    path = tmp_path / "buffered.swap"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        sizes = [1, 1000, 4097, 12345, 77]
        offsets = [sum(sizes[:i]) + 3 * i for i in range(len(sizes))]  # gaps, odd offsets
        written = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
        for request in [io.submit(path, fd, b, o, write=True) for b, o in zip(written, offsets)]:
            request.wait()
        read = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        for request in [io.submit(path, fd, b, o, write=False) for b, o in zip(read, offsets)]:
            request.wait()
        assert all(torch.equal(a, b) for a, b in zip(written, read))
    finally:
        os.close(fd)


def test_native_and_threads_report_a_failed_request_as_oserror(tmp_path):
    path = tmp_path / "data.swap"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    try:
        for io in (NativeFileIO(AioConfig()), ThreadFileIO(AioConfig())):
            misaligned = aligned_bytes(2 * ALIGN_BYTES)[1:ALIGN_BYTES + 1]  # O_DIRECT refuses it: EINVAL
            with pytest.raises(OSError, match="swap file failed") as caught:
                io.submit(path, fd, misaligned, 0, write=True).wait()
            assert caught.value.errno == errno.EINVAL and caught.value.filename == str(path)
    finally:
        os.close(fd)


def test_tier_slots_round_trip_unaligned_state_sizes_and_remove_their_file(tmp_path):
    tier = NvmeTier(tmp_path, slot_bytes=12 * 1000, budget_bytes=10**6, aio=AioConfig())
    assert tier.slot_bytes == 3 * ALIGN_BYTES
    offsets = [tier.allocate_slot() for _ in range(5)]
    buffers = [aligned_bytes(tier.slot_bytes) for _ in offsets]
    for buffer in buffers:
        buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8))
    for offset, buffer in zip(offsets, buffers):
        tier.write(offset, buffer)
    for offset, buffer in zip(offsets, buffers):
        back = aligned_bytes(tier.slot_bytes)
        tier.read(offset, back).wait()  # waits for the slot's own write first
        assert torch.equal(back, buffer)
    assert tier.used_bytes == 5 * tier.slot_bytes and os.fstat(tier.file.fd).st_size >= tier.used_bytes
    assert not tier.file.path.exists() and not list(tmp_path.iterdir()), "the swap file must have no name"
    tier.close()


def test_a_crashed_runs_swap_file_is_removed_and_a_live_one_kept(tmp_path, caplog):
    stale = tmp_path / f"{SWAP_PREFIX}host-1-rank0.swap"
    stale.write_bytes(b"x" * 8192)
    live = tmp_path / f"{SWAP_PREFIX}host-2-rank0.swap"
    live.write_bytes(b"y")
    holder = os.open(live, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with caplog.at_level(logging.WARNING):
            tier = NvmeTier(tmp_path, slot_bytes=ALIGN_BYTES, budget_bytes=10**6, aio=AioConfig())
        assert not stale.exists() and live.exists()
        assert "did not exit cleanly" in caplog.text
        tier.close()
    finally:
        os.close(holder)


def nvme_config(swap_dir: Path, seed: int, *, create: bool = True, **overrides) -> tuple[dict, int, int]:
    """Budgets under which the optimizer states land on all three tiers, swapping to ``swap_dir`` (created)."""
    if create:
        swap_dir.mkdir(exist_ok=True)
    device_budget, host_budget = budgets(six_layer_llama(seed))
    config = zero_cache_config(device_budget, host_budget // 2, clip=1.0, **overrides)
    config["zero_cache"]["nvme_path"] = str(swap_dir)
    return config, device_budget, host_budget // 2


def tiers_of(optimizer) -> list[str]:
    return [group.tier for group in optimizer.store.groups]


@pytest.mark.parametrize("clip", [1.0, 0.0])  # 0: host and disk chunks update during backward
def test_states_beyond_device_and_host_train_like_the_reference(tmp_path, clip):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=6, batch=8)
    config, device_budget, host_budget = nvme_config(tmp_path, seed)
    config["gradient_clipping"] = clip
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    tiers = tiers_of(optimizer)
    assert {DEVICE, HOST, NVME} <= set(tiers), f"the budgets must use all three tiers, got {tiers}"
    store = optimizer.store
    assert store.tiers[DEVICE].used_bytes <= device_budget and store.tiers[HOST].used_bytes <= host_budget
    losses = train_steps(engine, batches)
    report = optimizer.report()
    assert report["zero_cache_nvme_read_bytes"] > 0 and report["zero_cache_nvme_write_bytes"] > 0
    assert report["zero_cache_nvme_bytes"] == store.tiers[NVME].used_bytes > 0
    size = r"[\d.]+ [KMG]iB"
    assert re.search(rf", nvme {size}, .* disk read {size} write {size}", format_tiers(report))
    ref_losses, ref_masters = reference_loop(six_layer_llama(seed), batches, dtype=torch.bfloat16,
                                             accumulation=1, lr=3e-3, clip=clip)
    assert losses[-1] < losses[0] - 0.3, "the model must learn, or agreement proves little"
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    masters = optimizer.master_state_dict()
    initial = dict(six_layer_llama(seed).named_parameters())
    # Over the whole model (fused and foreach Adam round differently, and bf16 amplifies it; on CUDA a
    # single near-zero-gradient parameter can differ by more than it moved): far below the movement.
    moved = sum((expected.cpu() - initial[name].detach()).square().sum() for name, expected in ref_masters.items())
    diff = sum((masters[name] - expected.cpu()).square().sum() for name, expected in ref_masters.items())
    assert diff.sqrt() < 0.1 * moved.sqrt()
    swap = store.tiers[NVME].file.path
    optimizer.finish_pending()  # until the worker's last update ends, it holds the store
    alive = weakref.ref(optimizer)
    del engine, optimizer, store
    gc.collect()
    assert alive() is None, f"the dropped optimizer is still held by {holders(alive())}"
    assert not swap.exists(), "a dropped engine removes its swap file"


@pytest.mark.parametrize("in_backward", [True, False])
def test_the_plan_counts_the_disk_bytes_of_the_optimizer_groups_on_nvme(tmp_path, in_backward):
    """An unclipped step reads each NVMe group's states once and writes them back once: the plan's disk bytes per
    step, which its floor prices at the disk's rate, are exactly what the swap file moves (untied embeddings: a
    tied chunk's second update in backward reads its states once more, which the plan does not count)."""
    seed = torch.randint(0, 10_000, ()).item()

    def model() -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=4,
                                       hidden_size=32, num_heads=4, tie_embeddings=False))

    layout = pack([(n, tuple(p.shape)) for n, p in model().named_parameters()], CHUNK_NUMEL)
    states = layout.num_chunks * layout.chunk_numel * 16  # fp32: param, master, exp_avg, exp_avg_sq
    config = ds_config(gradient_clipping=0.0, zero_cache={
        "enabled": True, "chunk_size": CHUNK_NUMEL, "device_memory_budget": states // 4,
        "host_memory_budget": states // 2, "nvme_path": str(tmp_path), "update_in_backward": in_backward})
    engine, optimizer, _, _ = angelptm.initialize(model=model(), config=config)
    batches = random_batches(seed, count=4, batch=2)
    train_steps(engine, batches[:1])  # the warm-up, and the re-plan after it
    optimizer.finish_pending()
    optimizer.report()
    plan = optimizer.store.plan
    on_disk = sum(group.tier == NVME for group in optimizer.store.groups)
    assert on_disk >= 2 and plan.optimizer_tier.count(NVME) == on_disk
    for batch in batches[1:]:
        train_steps(engine, [batch])
        optimizer.finish_pending()
        report = optimizer.report()
        moved = report["zero_cache_nvme_read_bytes"] + report["zero_cache_nvme_write_bytes"]
        assert moved == plan.traffic.disk_bytes == 2 * on_disk * plan_slot_bytes(optimizer)
    assert plan.traffic.floors["disk"] == plan.traffic.disk_bytes / plan.traffic.rates.disk_bytes_per_s


def plan_slot_bytes(optimizer) -> int:
    """One NVMe group's slot in the swap file: its fp32 states in whole 4 KiB blocks."""
    return optimizer.store.tiers[NVME].slot_bytes


def holders(obj) -> list[str]:
    """What keeps ``obj`` alive, two levels up (for the failure message)."""
    def referrers(target) -> list:
        return [r for r in gc.get_referrers(target) if not isinstance(r, types.FrameType)]
    return [f"{type(r).__name__} <- {[type(up).__name__ for up in referrers(r)][:4]}" for r in referrers(obj)][:6]


EXITING_JOB = """
import sys
sys.path[:0] = {paths!r}
import angelptm
from angelptm.telemetry.monitor import format_tiers
from reference import random_batches, train_steps
from zero_cache_setup import budgets, six_layer_llama, zero_cache_config
device_budget, host_budget = budgets(six_layer_llama(0))
config = zero_cache_config(device_budget, host_budget // 2)
config["zero_cache"]["nvme_path"] = {directory!r}
engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(0), config=config)
train_steps(engine, random_batches(0, 2, 4))
print(optimizer.store.tiers["nvme"].file.path)  # exits with the engine alive and an update in flight
"""


def test_a_run_that_exits_leaves_no_swap_file(tmp_path):
    helpers = Path(__file__).resolve().parents[1] / "helpers"
    code = EXITING_JOB.format(paths=[str(helpers), str(helpers.parents[1])], directory=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    swap = Path(result.stdout.strip().splitlines()[-1])
    assert swap.parent == tmp_path and swap.name.startswith(SWAP_PREFIX)
    assert not swap.exists() and not list(tmp_path.iterdir())


def test_accumulating_micro_batches_with_disk_states_match_the_replicated_engine(tmp_path):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=6, batch=4)
    config, _, _ = nvme_config(tmp_path, seed, gradient_accumulation_steps=2)
    config["zero_cache"]["host_memory_budget"] *= 2  # room for the fp32 accumulators of the disk chunks
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    assert NVME in tiers_of(optimizer)
    plain_config = {k: v for k, v in config.items() if k != "zero_cache"}
    plain, plain_opt, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=plain_config)
    assert train_steps(engine, batches) == pytest.approx(train_steps(plain, batches), rel=1e-2)


def test_resume_with_disk_resident_state_is_exact(tmp_path):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=6, batch=4)
    config, _, _ = nvme_config(tmp_path / "swap", seed)
    straight, _, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    straight_losses = train_steps(straight, batches)
    first, _, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    train_steps(first, batches[:3])
    first.save_checkpoint(tmp_path / "ckpt")
    resumed, resumed_opt, _, _ = angelptm.initialize(model=six_layer_llama(seed + 1), config=config)
    assert NVME in tiers_of(resumed_opt)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train_steps(resumed, batches[3:]) == straight_losses[3:]


def test_bad_paths_and_a_too_small_disk_budget_stop_before_training(tmp_path):
    seed = 0
    config, _, _ = nvme_config(tmp_path / "missing", seed, create=False)
    with pytest.raises(angelptm.ConfigError, match=r"nvme_path: .*missing.* is not an existing directory.*mkdir -p"):
        angelptm.initialize(model=six_layer_llama(seed), config=config)
    config, _, _ = nvme_config(tmp_path, seed)
    config["zero_cache"]["nvme_memory_budget"] = 4096
    with pytest.raises(angelptm.ConfigError, match=r"nvme tier needs .*short by .*free disk space"):
        angelptm.initialize(model=six_layer_llama(seed), config=config)
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory; set nvme_path to a directory") as refused:
        check_directory(str(a_file))
    assert "mkdir" not in str(refused.value)  # it used to advise `mkdir -p` of the file


class FullDisk:
    """An IO backend whose writes fail with ENOSPC after ``allowed`` requests (a disk filling up mid-run)."""

    name = "full disk"

    def __init__(self, real, allowed: int) -> None:
        self.real, self.allowed = real, allowed

    def submit(self, path, fd, buffer, offset, *, write):
        if write:
            self.allowed -= 1
            if self.allowed < 0:
                return FailedRequest(OSError(errno.ENOSPC, "writing the NVMe tier's swap file failed: "
                                                           + os.strerror(errno.ENOSPC), str(path)))
        return self.real.submit(path, fd, buffer, offset, write=write)


class FailedRequest:
    def __init__(self, error: OSError) -> None:
        self.error = error

    def done(self) -> bool:
        raise self.error

    def wait(self) -> None:
        raise self.error


def test_a_disk_filling_up_mid_run_stops_with_a_clear_error_and_keeps_the_checkpoint(tmp_path):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=6, batch=4)
    config, _, _ = nvme_config(tmp_path / "swap", seed)
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    train_steps(engine, batches[:2])
    engine.save_checkpoint(tmp_path / "ckpt")
    saved = optimizer.master_state_dict()
    nvme = optimizer.store.tiers[NVME]
    nvme.io = FullDisk(nvme.io, allowed=2)
    with pytest.raises(OSError, match="No space left on device") as caught:
        train_steps(engine, batches[2:])
        optimizer.finish_pending()
    assert caught.value.errno == errno.ENOSPC
    restored, restored_opt, _, _ = angelptm.initialize(model=six_layer_llama(seed + 1), config=config)
    restored.load_checkpoint(tmp_path / "ckpt")
    for name, expected in saved.items():
        torch.testing.assert_close(restored_opt.master_state_dict()[name], expected, rtol=0, atol=0)


def test_a_host_budget_equal_to_the_planned_host_bytes_is_enough(tmp_path):
    """The plan counts what the host tier allocates, bounce buffers' alignment slack included."""
    import zero_cache
    from angelptm.config.loader import load_config

    seed = torch.randint(0, 10_000, ()).item()
    config, _, _ = nvme_config(tmp_path, seed)
    cfg = load_config(config)
    shapes = [(name, tuple(p.shape)) for name, p in six_layer_llama(seed).named_parameters()]
    plan = zero_cache.dry_run(shapes, cfg.zero_cache, compute_dtype=cfg.precision.dtype,
                              device=torch.device("cpu")).plan
    assert NVME in plan.optimizer_tier
    config["zero_cache"]["host_memory_budget"] = plan.host_bytes
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    assert tiers_of(optimizer) == list(plan.optimizer_tier)
    train_steps(engine, random_batches(seed, count=2, batch=4))
    assert optimizer.store.tiers[HOST].peak_bytes == plan.host_bytes


def test_a_filesystem_refusing_o_direct_at_open_falls_back_to_buffered_io(tmp_path, monkeypatch, caplog):
    import zero_cache.storage.nvme as nvme

    real_open = os.open

    def open_like_old_tmpfs(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            real_open(path, flags & ~os.O_DIRECT, *args)  # the kernel creates the file, then refuses the flag
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(nvme.os, "open", open_like_old_tmpfs)
    with caplog.at_level(logging.WARNING):
        tier = NvmeTier(tmp_path, slot_bytes=ALIGN_BYTES, budget_bytes=10**6, aio=AioConfig())
    assert not tier.file.direct and "does not support O_DIRECT" in caplog.text
    offset, data = tier.allocate_slot(), aligned_bytes(ALIGN_BYTES).random_(0, 256)
    tier.write(offset, data)
    back = aligned_bytes(ALIGN_BYTES)
    tier.read(offset, back).wait()
    assert torch.equal(back, data)
    tier.close()
    assert not list(tmp_path.iterdir())


SWAP_HOLDER = """
import os, signal, sys
sys.path[:0] = {paths!r}
from pathlib import Path
from zero_cache.config import AioConfig
from zero_cache.storage.nvme import NvmeTier
tier = NvmeTier(Path({directory!r}), slot_bytes={slot_bytes}, budget_bytes={slot_bytes}, aio=AioConfig())
tier.allocate_slot()  # reserves the slot's blocks on disk (posix_fallocate)
print("ready", flush=True)
sys.stdin.readline()
how = {how!r}
if how == "exception":
    raise RuntimeError("a failing step")
if how == "os._exit":
    os._exit(3)
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


@pytest.mark.parametrize("how", ["return", "exception", "os._exit", "sigkill"])
def test_no_exit_path_leaves_the_swap_file_or_its_space(tmp_path, how):
    slot_bytes = 512 << 20
    root = Path(__file__).resolve().parents[2]
    code = SWAP_HOLDER.format(paths=[str(root)], directory=str(tmp_path), slot_bytes=slot_bytes, how=how)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()[-2000:]
        held = free_bytes(tmp_path)
        assert not list(tmp_path.iterdir()), "the swap file must have no name while it is used"
        child.stdin.write("go\n")
        child.stdin.flush()
        child.wait(timeout=60)
    finally:
        child.kill()
    expected = {"return": 0, "exception": 1, "os._exit": 3, "sigkill": -signal.SIGKILL}[how]
    assert child.returncode == expected
    assert not list(tmp_path.iterdir())
    assert free_bytes(tmp_path) - held >= 0.8 * slot_bytes, "the swap file's blocks were not given back"
