"""Our fp16 loss scaler against DeepSpeed's ``DynamicLossScaler``, update by update."""

from __future__ import annotations

import datetime
import importlib
import logging
import random

import pytest
import torch
import torch.distributed as tdist
from launch import free_port  # tests/helpers

from angelptm.config import LossScaleConfig
from angelptm.engine.loss_scaler import LossScaler

ds_loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def ds_comm():
    """A single-process gloo group that ``deepspeed.comm.get_rank()`` (called by update_scale) can answer from.

    ``deepspeed.comm.init_distributed`` would JIT-compile DeepSpeed's shared-memory op (over a minute
    on CPU), so its TorchBackend is built over the already-initialised torch group with that build
    skipped, and installed as deepspeed.comm's backend for the module's tests only.
    """
    # importlib: the attribute deepspeed.comm.torch is the torch package, not the submodule
    ds_comm_module = importlib.import_module("deepspeed.comm.comm")
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")

    created = False
    if not tdist.is_initialized():
        tdist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
        created = True
    previous = ds_comm_module.cdb
    with pytest.MonkeyPatch.context() as patch:
        if previous is None or not previous.is_initialized():
            patch.setattr(ds_comm_torch, "build_shm_op", lambda: None)
            backend = ds_comm_torch.TorchBackend("gloo", datetime.timedelta(seconds=60), None)
            patch.setattr(ds_comm_module, "cdb", backend)
        assert ds_comm_module.get_rank() == 0
        yield
    if created:
        tdist.destroy_process_group()


def make_pair(power: int, window: int, hysteresis: int, consecutive: bool, min_scale: float):
    mine = LossScaler(LossScaleConfig(initial_scale_power=power, window=window, hysteresis=hysteresis,
                                      consecutive_hysteresis=consecutive, min_scale=min_scale))
    theirs = ds_loss_scaler.DynamicLossScaler(init_scale=2**power, scale_window=window, min_scale=min_scale,
                                              delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
    return mine, theirs


def overflow_sequence(rng: random.Random, length: int) -> list[bool]:
    """Bursts of overflows (length 1-6) separated by clean runs of very different lengths."""
    sequence: list[bool] = []
    while len(sequence) < length:
        kind = rng.random()
        if kind < 0.35:
            sequence += [True] * rng.randint(1, 6)
        elif kind < 0.55:
            sequence += [rng.random() < 0.3 for _ in range(rng.randint(5, 30))]  # scattered overflows
        else:
            sequence += [False] * rng.choice([rng.randint(1, 10), rng.randint(10, 120)])
    return sequence[:length]


def run_both(mine: LossScaler, theirs, sequence: list[bool], trace: list | None = None) -> int:
    """Apply the same flags to both, comparing after every update; returns the updates applied.

    Both must raise at the same update if the scale is already at its minimum.
    """
    for index, overflow in enumerate(sequence):
        try:
            theirs.update_scale(overflow)
        except Exception as their_error:  # DeepSpeed raises a bare Exception here
            assert "minimum" in str(their_error)
            with pytest.raises(FloatingPointError, match="min_loss_scale"):
                mine.update(overflow)
            return index
        mine.update(overflow)
        assert mine.cur_scale == theirs.cur_scale, f"update {index}"
        assert mine.cur_hysteresis == theirs.cur_hysteresis, f"update {index}"
        assert mine.scale == theirs.loss_scale
        if trace is not None:
            trace.append((mine.cur_scale, mine.cur_hysteresis))
    assert mine.cur_iter == theirs.cur_iter and mine.last_overflow_iter == theirs.last_overflow_iter
    return len(sequence)


SETTINGS = [
    # (initial_scale_power, window, hysteresis, consecutive_hysteresis, min_scale)
    (16, 1000, 2, False, 1.0),      # DeepSpeed's defaults
    (16, 1, 1, False, 1.0),
    (20, 2, 2, False, 1.0),
    (20, 2, 2, True, 1.0),
    (24, 7, 3, False, 0.25),
    (24, 7, 3, True, 0.25),
    (12, 25, 5, False, 1.0),
    (12, 25, 5, True, 1.0),
    (30, 50, 1, True, 2.0),
    (8, 3, 2, False, 3.0),          # a min scale that halving never lands on exactly
    (8, 3, 1, False, 3.0),
]


@pytest.mark.usefixtures("ds_comm")
@pytest.mark.parametrize("settings", SETTINGS, ids=[f"p{p}-w{w}-h{h}-{'c' if c else 'nc'}-m{m}"
                                                    for p, w, h, c, m in SETTINGS])
def test_matches_deepspeed_on_random_overflow_sequences(settings):
    total, trace = 0, []
    for seed in range(6):
        rng = random.Random(100 * SETTINGS.index(settings) + seed)
        mine, theirs = make_pair(*settings)
        sequence = overflow_sequence(rng, rng.randint(200, 600))
        total += run_both(mine, theirs, sequence, trace)
    assert total > 300  # sequences were mostly applied, not cut short at the first update
    # the sequences exercised the interesting transitions: halving, and hysteresis being spent
    scales = [scale for scale, _ in trace]
    assert any(later < earlier for earlier, later in zip(scales, scales[1:]))
    if settings[2] > 1:
        assert min(h for _, h in trace) < settings[2]
    if settings[1] < 100:  # windows short enough for the clean runs to double the scale
        assert any(later > earlier for earlier, later in zip(scales, scales[1:]))


@pytest.mark.usefixtures("ds_comm")
@pytest.mark.parametrize("hysteresis, consecutive", [(1, False), (2, False), (3, True), (4, False)])
def test_min_scale_overflow_raises_like_deepspeed(hysteresis, consecutive):
    rng = random.Random(hysteresis * 10 + consecutive)
    power, min_scale = rng.randint(3, 8), rng.choice([1.0, 0.5, 3.0])
    mine, theirs = make_pair(power, 100, hysteresis, consecutive, min_scale)
    applied = run_both(mine, theirs, [True] * 200)
    assert applied < 200  # both raised
    assert mine.cur_scale == theirs.cur_scale == min_scale
    with pytest.raises(FloatingPointError, match="min_loss_scale"):
        mine.update(True)


def test_min_scale_overflow_message():
    scaler = LossScaler(LossScaleConfig(initial_scale_power=2, window=10, hysteresis=1, min_scale=1.0))
    for expected in (2.0, 1.0):
        scaler.update(True)
        assert scaler.cur_scale == expected
    with pytest.raises(FloatingPointError) as info:
        scaler.update(True)
    assert "fp16.min_loss_scale=1" in str(info.value) and "fp16.initial_scale_power=2" in str(info.value)
    assert scaler.cur_scale == 1.0
    # a clean step is still accepted at the minimum and the scale can grow back
    for _ in range(11):
        scaler.update(False)
    assert scaler.cur_scale == 2.0


def test_halving_clamps_to_min_scale():
    scaler = LossScaler(LossScaleConfig(initial_scale_power=5, window=1000, hysteresis=1, min_scale=3.0))
    seen = []
    for _ in range(4):
        scaler.update(True)
        seen.append(scaler.cur_scale)
    assert seen == [16.0, 8.0, 4.0, 3.0]


@pytest.mark.usefixtures("ds_comm")
def test_static_scale_never_changes():
    rng = random.Random(42)
    static = float(2 ** rng.randint(0, 20))
    mine = LossScaler(LossScaleConfig(static_scale=static, window=1, hysteresis=1, min_scale=static * 4))
    theirs = ds_loss_scaler.LossScaler(scale=static)
    assert not mine.dynamic
    for overflow in overflow_sequence(rng, 500):
        mine.update(overflow)
        theirs.update_scale(overflow)
        assert mine.scale == theirs.loss_scale == static
    assert mine.cur_iter == 0  # a static scaler keeps no history


def test_dynamic_starts_at_initial_power():
    rng = random.Random(7)
    power = rng.randint(0, 32)
    scaler = LossScaler(LossScaleConfig(initial_scale_power=power))
    assert scaler.dynamic and scaler.scale == float(2**power)


@pytest.mark.usefixtures("ds_comm")
@pytest.mark.parametrize("settings", SETTINGS[1::2])
def test_state_dict_round_trip(settings):
    rng = random.Random(7 + SETTINGS.index(settings))
    settings = (40,) + settings[1:]  # start high so the minimum scale is not reached before the split
    mine, theirs = make_pair(*settings)
    sequence = overflow_sequence(rng, 400)
    split = rng.randint(50, 350)
    assert run_both(mine, theirs, sequence[:split]) == split
    state = mine.state_dict()
    assert state["cur_scale"] == theirs.cur_scale and state["cur_iter"] == theirs.cur_iter

    restored = LossScaler(LossScaleConfig(initial_scale_power=settings[0], window=settings[1],
                                          hysteresis=settings[2], consecutive_hysteresis=settings[3],
                                          min_scale=settings[4]))
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    for index, overflow in enumerate(sequence[split:]):
        try:
            theirs.update_scale(overflow)
        except Exception:
            with pytest.raises(FloatingPointError):
                restored.update(overflow)
            break
        mine.update(overflow)
        restored.update(overflow)
        assert restored.cur_scale == mine.cur_scale == theirs.cur_scale, index
        assert restored.cur_hysteresis == mine.cur_hysteresis == theirs.cur_hysteresis, index


def test_state_dict_survives_torch_save(tmp_path):
    rng = random.Random(5)
    scaler = LossScaler(LossScaleConfig(initial_scale_power=16, window=4, hysteresis=3))
    for overflow in overflow_sequence(rng, 97):
        scaler.update(overflow)
    path = tmp_path / "scaler.pt"
    torch.save(scaler.state_dict(), path)
    restored = LossScaler(LossScaleConfig(initial_scale_power=16, window=4, hysteresis=3))
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.state_dict() == scaler.state_dict()
