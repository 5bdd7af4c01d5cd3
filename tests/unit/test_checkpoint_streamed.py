"""ZeRO-Cache checkpoints streamed through a few staged chunks, and written beside training
(``save_checkpoint(background=True)``; :mod:`angelptm.checkpoints.background`)."""

from __future__ import annotations

import errno
import functools
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from checkpoint_compare import assert_equal, load_states
from reference import random_batches, train_steps
from zero_cache_setup import CHUNK_NUMEL, budgets, six_layer_llama, zero_cache_config

import angelptm
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import manifest as checkpoint_manifest
from angelptm.checkpoints import streamed

ROOT = Path(__file__).resolve().parents[2]
STATE_BYTES_PER_ELEMENT = 12  # fp32 master, exp_avg, exp_avg_sq
LARGEST_SAVE_CHUNKS = 180
"""Chunks of the largest state :func:`test_staging_is_k_chunks_whatever_the_model_size` saves (60 layers)."""


def engine_of(seed: int, *, num_layers: int = 6, nvme_path: Path | None = None):
    """A llama of ``num_layers`` under ZeRO-Cache, its states split between the device and host budgets (a chunk
    of 8192 elements: 18 chunks at six layers), params resident, host chunks updated during backward; with
    ``nvme_path``, the host holds a third of the states and the rest goes to disk."""
    model = lambda: six_layer_llama(seed) if num_layers == 6 else _llama(seed, num_layers)  # noqa: E731
    device_budget, host_budget = budgets(model())
    config = zero_cache_config(device_budget, host_budget if nvme_path is None else host_budget // 3)
    config["zero_cache"]["param_home"] = "device"
    if nvme_path is not None:
        config["zero_cache"]["nvme_path"] = str(nvme_path)
    engine, optimizer, _, _ = angelptm.initialize(model=model(), config=config)
    return engine, optimizer


def _llama(seed: int, num_layers: int) -> torch.nn.Module:
    from reference import SEQ, VOCAB

    from angelptm.pretraining.models import ModelConfig, build_model

    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=num_layers,
                                   hidden_size=32, num_heads=4))




def slow_writer(monkeypatch, seconds_per_chunk: float) -> None:
    """Each staged chunk's records take ``seconds_per_chunk`` more to write (a slow disk)."""
    real = streamed._ArchiveWriter.write_chunk

    def write_chunk(self, staged, snapshot):
        if self.plan.refs:
            time.sleep(seconds_per_chunk)
        return real(self, staged, snapshot)

    monkeypatch.setattr(streamed._ArchiveWriter, "write_chunk", write_chunk)


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("checkpoint-writer")]


@pytest.mark.parametrize("disk", [False, True], ids=["host", "nvme"])
def test_a_background_save_with_training_going_on_equals_a_synchronous_save_and_resumes_exactly(tmp_path,
                                                                                                monkeypatch, disk):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=8, batch=4)
    engine_of = functools.partial(globals()["engine_of"], nvme_path=tmp_path if disk else None)
    straight, straight_opt = engine_of(seed)
    if disk:
        assert any(group.tier == "nvme" for group in straight_opt.store.groups), "some states must be on disk"
    train_steps(straight, batches[:4])
    straight.save_checkpoint(tmp_path / "sync", tag="step4")  # the reference: written before it returns
    straight_losses = train_steps(straight, batches[4:])

    slow_writer(monkeypatch, 0.05)
    live, live_opt = engine_of(seed)
    train_steps(live, batches[:4])
    snapshots = []
    begin = live_opt.begin_snapshot
    monkeypatch.setattr(live_opt, "begin_snapshot", lambda **kw: snapshots.append(begin(**kw)) or snapshots[-1])
    live.save_checkpoint(tmp_path / "async", tag="step4", background=True, max_staged_chunks=2)
    assert writer_threads(), "the save returned before its files were written"
    loss = live(**batches[4])
    live.backward(loss)
    assert writer_threads(), "a forward and backward ran while the writer was still writing"
    live.step()  # each chunk not written yet is staged before this step changes it
    live_losses = [loss.item()] + train_steps(live, batches[5:])
    assert live_losses == straight_losses, "the save changed the training it ran beside"
    assert live.wait_for_checkpoint() == tmp_path / "async" / "step4"
    assert not writer_threads()
    assert snapshots[0].staged_before_update > 0, "the step must have overtaken the writer, or this proves little"
    assert (tmp_path / "async" / "latest").read_text() == "step4"
    for saved, expected in zip(load_states(tmp_path / "async" / "step4"), load_states(tmp_path / "sync" / "step4")):
        assert_equal(saved, expected)

    resumed, resumed_opt = engine_of(seed + 1)
    resumed.load_checkpoint(tmp_path / "async")
    assert train_steps(resumed, batches[4:]) == straight_losses
    assert_equal(resumed_opt.state_dict(), straight_opt.state_dict())


def test_a_second_save_waits_for_the_first_and_destroy_finishes_one_in_flight(tmp_path, monkeypatch):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=2, batch=4)
    slow_writer(monkeypatch, 0.02)
    engine, _ = engine_of(seed)
    train_steps(engine, batches[:1])
    engine.save_checkpoint(tmp_path, tag="first", background=True)
    engine.save_checkpoint(tmp_path, tag="second", background=True)  # waits for "first" to be published
    assert (tmp_path / "first" / checkpoint_manifest.MANIFEST_FILE).is_file()
    train_steps(engine, batches[1:])
    engine.destroy()  # waits for "second"
    assert not writer_threads()
    assert (tmp_path / "latest").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".writer.lock", "first", "latest", "second"]
    fresh, _ = engine_of(seed)
    assert Path(fresh.load_checkpoint(tmp_path)[0]).name == "second" and fresh.global_steps == 1


def test_a_failed_background_write_keeps_latest_and_is_raised_at_the_next_step(tmp_path, monkeypatch):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=6, batch=4)
    engine, _ = engine_of(seed)
    train_steps(engine, batches[:1])
    engine.save_checkpoint(tmp_path, tag="good")
    real_write = checkpoint_manifest._HashingFile._write

    def full_after_a_page(self, data):  # the disk fills up in the middle of the optimizer's file
        if self.size_bytes > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(checkpoint_manifest._HashingFile, "_write", full_after_a_page)
    try:
        engine.save_checkpoint(tmp_path, tag="bad", background=True, max_staged_chunks=1)
        raised_by_the_save = None
    except OSError as err:  # (on a loaded machine the writer can fail before the save returns: the save raises it)
        raised_by_the_save = err
    loss = engine(**batches[1])  # training goes on (the step does not wait for a writer that stopped)
    engine.backward(loss)
    while writer_threads():
        time.sleep(0.01)
    if raised_by_the_save is None:
        with pytest.raises(OSError, match="No space left") as caught:
            engine.step()
        error = caught.value
    else:
        error = raised_by_the_save
    assert error.errno == errno.ENOSPC and "No space left" in str(error)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".writer.lock", "good", "latest"]  # no .tmp-*
    engine.step()  # raised once: the step the error stopped is taken now
    train_steps(engine, batches[2:3])
    engine.save_checkpoint(tmp_path, tag="next", background=True)
    assert engine.wait_for_checkpoint() == tmp_path / "next"
    assert (tmp_path / "latest").read_text() == "next"


def test_latest_moves_only_after_every_file_is_complete_and_fsynced(tmp_path, monkeypatch):
    seed = torch.randint(0, 10_000, ()).item()
    engine, _ = engine_of(seed)
    train_steps(engine, random_batches(seed, count=1, batch=4))
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    slow_writer(monkeypatch, 0.02)
    engine.save_checkpoint(tmp_path, tag="t", background=True)
    assert not (tmp_path / "latest").exists()  # not while the writer is writing
    engine.wait_for_checkpoint()
    names = [checkpoint.MODEL_FILE, checkpoint.OPTIM_FILE, checkpoint.rank_file(0), "manifest.json"]
    moved = events.index(("replace", str(tmp_path / "latest")))
    for name in names:
        synced = [i for i, (kind, path) in enumerate(events) if kind == "fsync" and path.endswith("/" + name)]
        assert synced and synced[-1] < moved, f"{name} was not fsynced before latest moved"
    assert (tmp_path / "latest").read_text() == "t"


EXIT_JOB = """
import sys, time
sys.path.insert(0, {helpers!r})
sys.path.insert(0, {tests!r})
from angelptm.checkpoints import streamed
from reference import random_batches, train_steps
from test_checkpoint_streamed import engine_of

real = streamed._ArchiveWriter.write_chunk
def slow(self, staged, snapshot):  # a slow disk: the script ends long before the writer does
    time.sleep(0.05)
    return real(self, staged, snapshot)
streamed._ArchiveWriter.write_chunk = slow
engine, _ = engine_of(0)
train_steps(engine, random_batches(0, count=1, batch=4))
engine.save_checkpoint({save_dir!r}, background=True, max_staged_chunks=1)
print("returned", flush=True)
"""


def test_a_script_ending_right_after_a_background_save_leaves_it_complete(tmp_path):
    job = EXIT_JOB.format(helpers=str(ROOT / "tests" / "helpers"), tests=str(ROOT / "tests" / "unit"),
                          save_dir=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "returned" in result.stdout, result.stderr[-3000:]
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".writer.lock", "global_step1", "latest"]
    fresh, _ = engine_of(1)
    assert Path(fresh.load_checkpoint(tmp_path)[0]).name == "global_step1" and fresh.global_steps == 1


def counting_allocator() -> tuple[callable, dict]:
    """A staging allocator that counts the bytes of its live buffers (and their peak)."""
    count = {"live": 0, "peak": 0, "made": 0}

    def allocate(numel: int) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=torch.float32)
        count["live"] += buffer.nbytes
        count["made"] += 1
        count["peak"] = max(count["peak"], count["live"])
        weakref.finalize(buffer, lambda n=buffer.nbytes: count.__setitem__("live", count["live"] - n))
        return buffer

    return allocate, count


@pytest.mark.parametrize("max_staged", [1, 3])
def test_staging_is_k_chunks_whatever_the_model_size(tmp_path, monkeypatch, max_staged):
    """A state many times the staging (6 to 60 layers: 18 to 180 chunks) stages the same bytes: K chunks."""
    peaks = {}
    for num_layers in (6, 60):
        engine, optimizer = engine_of(0, num_layers=num_layers)
        train_steps(engine, random_batches(0, count=1, batch=4))
        allocate, count = counting_allocator()
        begin, snapshots = optimizer.begin_snapshot, []
        monkeypatch.setattr(optimizer, "begin_snapshot",
                            lambda **kw: snapshots.append(begin(**kw, allocate=allocate)) or snapshots[-1])
        engine.save_checkpoint(tmp_path / str(num_layers), background=True, max_staged_chunks=max_staged)
        train_steps(engine, random_batches(1, count=2, batch=4))  # the steps overtake the writer
        engine.wait_for_checkpoint()
        snapshot = snapshots[0]
        assert snapshot.num_chunks == {6: 18, 60: LARGEST_SAVE_CHUNKS}[num_layers]
        state_bytes = snapshot.num_chunks * STATE_BYTES_PER_ELEMENT * CHUNK_NUMEL
        bound = max_staged * STATE_BYTES_PER_ELEMENT * CHUNK_NUMEL
        assert count["made"] == max_staged and count["peak"] == bound, count
        assert snapshot.peak_staged_bytes <= bound + 2 * CHUNK_NUMEL  # (+ one weight cast to bf16 while written)
        peaks[num_layers] = (count["peak"], state_bytes)
        engine.destroy()
    assert peaks[6][0] == peaks[60][0]
    assert peaks[60][1] >= 50 * peaks[60][0], "the state must be many times the staging"


def test_a_13b_state_stages_the_same_k_chunks_by_arithmetic():
    """13B by arithmetic, the staging by the test above. The GPT-2 of 40 layers x 5120 (vocab 50304: 12.8 B
    parameters), laid out on the meta device by the engine's own chunk search, has 41 chunks of 314.7 M elements:
    fewer than the 180 the test above saves with the same K buffers, which it counts whatever the number of chunks.
    So a 13B save stages K x 12 B x 314.7 M (7.6 GB at the default K = 2) of its 154 GB of states."""
    from angelptm.checkpoints.engine_save import STAGED_CHUNKS
    from angelptm.pretraining.models import ModelConfig, build_model
    from zero_cache import ZeroCacheConfig
    from zero_cache.resolve import build_layout

    with torch.device("meta"):
        model = build_model(ModelConfig(flavour="gpt2", vocab_size=50304, max_seq_len=1024, num_layers=40,
                                        hidden_size=5120, num_heads=40))
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    layout = build_layout(shapes, ZeroCacheConfig(chunk_size="auto"))
    state_bytes = STATE_BYTES_PER_ELEMENT * sum(p.numel() for p in model.parameters())
    staged_bytes = STAGED_CHUNKS * STATE_BYTES_PER_ELEMENT * layout.chunk_numel
    assert 12.5e9 < state_bytes / STATE_BYTES_PER_ELEMENT < 13.5e9, "not a 13B model"
    assert layout.num_chunks <= LARGEST_SAVE_CHUNKS, (layout.num_chunks, "more chunks than the test above shows")
    assert layout.chunk_numel >= max(math.prod(shape) for _, shape in shapes)  # (a chunk holds the largest tensor)
    assert round(staged_bytes / 1e9, 1) == 7.6 and round(state_bytes / 1e9) == 154
    assert staged_bytes < 128 * 2**30 / 16, "a 13B save's staging must be a small part of a 128 GiB host"
    assert state_bytes > 128 * 2**30, "the whole state, what the save used to stage, does not fit that host"


RSS_JOB = """
import os, sys, torch, angelptm
sys.path.insert(0, {helpers!r})
from pathlib import Path
from angelptm.checkpoints import files
from angelptm.pretraining.models import ModelConfig, build_model
from reference import random_batches, train_steps

def engine():
    torch.manual_seed(0)
    model = build_model(ModelConfig(flavour="llama", vocab_size=64, max_seq_len=16, num_layers=8, hidden_size=512,
                                    num_heads=8))
    return angelptm.initialize(model=model, config={{
        "train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
        "zero_cache": {{"enabled": True, "chunk_size": 1 << 21, "param_home": "device",
                        "device_memory_budget": 256 << 20, "host_memory_budget": 1 << 30}}}})[:2]

def peak_growth(action):
    rss = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) << 10
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the RSS now
    before = rss("VmRSS:")
    action()
    return rss("VmHWM:") - before

saver, optimizer = engine()
numel = sum(p.numel() for p in saver.module.parameters())
train_steps(saver, random_batches(0, count=1, batch=2))
save_growth = peak_growth(lambda: saver.save_checkpoint({save_dir!r}, max_staged_chunks=2))
whole_copy_growth = peak_growth(lambda: optimizer.state_dict())  # what the save used to stage
saver.destroy()
loader, loader_optimizer = engine()
loader.load_checkpoint({save_dir!r})  # (first: the states' own pages, untouched zeros so far, are then resident)
optim_file = Path({save_dir!r}) / "global_step1" / files.OPTIM_FILE
load = lambda lazy: loader_optimizer.load_state_dict(files.load_file(optim_file, lazy=lazy)["optimizer"])
load_growth = peak_growth(lambda: load(True))  # as load_checkpoint reads ZeRO-Cache's states now
mapped_growth = peak_growth(lambda: load(False))  # as it did: the file mapped whole
print(numel, save_growth, whole_copy_growth, load_growth, mapped_growth)
"""


@pytest.fixture(scope="module")
def rss_growth(tmp_path_factory) -> dict[str, int]:
    """Peak RSS growth (the kernel's high-water mark, reset before each) of a process saving and loading the
    states of 25.7 M parameters (294 MiB; chunks of 2 Mi elements: 24 MiB of states), and of the old ways."""
    job = RSS_JOB.format(helpers=str(ROOT / "tests" / "helpers"), save_dir=str(tmp_path_factory.mktemp("rss")))
    result = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    values = map(int, result.stdout.split()[-5:])
    return dict(zip(("numel", "save", "whole_copy", "load", "mapped"), values))


def test_host_memory_during_a_save_grows_by_the_staged_chunks_not_the_state(rss_growth):
    state_bytes = STATE_BYTES_PER_ELEMENT * rss_growth["numel"]
    staged = 2 * STATE_BYTES_PER_ELEMENT * (1 << 21)
    assert rss_growth["whole_copy"] > 0.9 * state_bytes, "the measurement must see a whole copy of the state"
    assert rss_growth["save"] < staged + (16 << 20), rss_growth


def test_host_memory_while_the_states_load_grows_by_a_tensor_not_the_file(rss_growth):
    state_bytes = STATE_BYTES_PER_ELEMENT * rss_growth["numel"]
    assert rss_growth["mapped"] > 0.9 * state_bytes, "the measurement must see the mapped file's pages"
    assert rss_growth["load"] < 24 << 20, rss_growth  # (the largest tensor: 2.8 Mi fp32 = 11 MiB, one at a time)
