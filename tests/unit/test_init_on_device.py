"""RandomFillsOnDevice: random fills of large host tensors drawn on an accelerator, piece by piece.

On CPU machines "cpu" stands for the accelerator, with tiny pieces, so the routing, the piecing and the
values are checked here; the gpu-marked test draws on a real GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, train_steps
from torch import nn

import angelptm
from angelptm.engine.init_on_device import RandomFillsOnDevice
from angelptm.pretraining.models import ModelConfig, build_model

PIECE_BYTES, MIN_NUMEL = 4096, 1000
BIG, SMALL = (300, 200), (10, 20)  # 60,000 elements (15 fp32 pieces, 8 bf16 ones), and 200


def fills(device: str = "cpu") -> RandomFillsOnDevice:
    return RandomFillsOnDevice(torch.device(device), piece_bytes=PIECE_BYTES, min_numel=MIN_NUMEL)


def pieces_of(tensor: torch.Tensor) -> int:
    return math.ceil(tensor.numel() * tensor.element_size() / PIECE_BYTES)


INITS = {  # name: (fill, check of the values)
    "Tensor.normal_": (lambda w: w.normal_(1.0, 2.0), lambda w: (w.mean(), w.std()) == pytest.approx((1, 2), abs=0.05)),
    "Tensor.uniform_": (lambda w: w.uniform_(-3.0, 5.0),
                        lambda w: -3 <= w.min() and w.max() <= 5 and w.mean() == pytest.approx(1, abs=0.05)),
    "init.normal_": (lambda w: nn.init.normal_(w, std=0.02), lambda w: w.std() == pytest.approx(0.02, rel=0.03)),
    "init.trunc_normal_": (lambda w: nn.init.trunc_normal_(w, std=1.0, a=-0.5, b=1.5),
                           lambda w: -0.5 <= w.min() and w.max() <= 1.5 and w.std() > 0.4),
    "init.kaiming_uniform_": (lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)),
                              lambda w: w.abs().max() <= 1.01 / math.sqrt(200) and w.std() > 0.03),  # 1%: bf16 rounding
    "init.xavier_normal_": (lambda w: nn.init.xavier_normal_(w),
                            lambda w: w.std() == pytest.approx(math.sqrt(2 / 500), rel=0.03)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(INITS))
def test_large_fills_are_drawn_in_pieces_with_the_right_values_and_small_ones_stay(name, dtype):
    fill, check = INITS[name]
    big, small = torch.zeros(BIG, dtype=dtype), torch.zeros(SMALL, dtype=dtype)
    with fills() as mode:
        assert fill(big) is big
        routed = mode.pieces_filled
        fill(small)
    assert routed >= pieces_of(big) and routed % pieces_of(big) == 0  # trunc_normal_ may redraw whole tensors
    assert mode.pieces_filled == routed, "the small tensor was filled on the CPU"
    assert big.dtype == dtype and big.shape == BIG and check(big.float())
    assert small.std() > 0


def test_a_contiguous_view_is_filled_in_place_and_a_strided_one_on_the_cpu():
    base = torch.zeros(4 * MIN_NUMEL)
    transposed = torch.zeros(100, 50).t()
    with fills() as mode:
        base[MIN_NUMEL:].normal_()
        assert mode.pieces_filled == pieces_of(base[MIN_NUMEL:])
        transposed.uniform_(2.0, 3.0)
        assert mode.pieces_filled == pieces_of(base[MIN_NUMEL:])
    assert (base[:MIN_NUMEL] == 0).all() and base[MIN_NUMEL:].std() == pytest.approx(1, abs=0.05)
    assert (transposed >= 2).all() and (transposed <= 3).all()


def test_a_fill_with_its_own_generator_stays_on_the_cpu_and_draws_from_it():
    expected = torch.empty(BIG).normal_(generator=torch.Generator().manual_seed(3))
    with fills() as mode:
        drawn = torch.empty(BIG).normal_(generator=torch.Generator().manual_seed(3))
    assert mode.pieces_filled == 0 and torch.equal(drawn, expected)


def test_the_same_seed_builds_the_same_weights():
    def build(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with fills():
            return nn.Linear(300, 200).weight.detach().clone()
    assert torch.equal(build(0), build(0)) and not torch.equal(build(0), build(1))


def test_autograd_still_refuses_an_in_place_fill_of_a_leaf_that_requires_grad():
    param = nn.Parameter(torch.zeros(BIG))
    with fills(), pytest.raises(RuntimeError, match="leaf Variable"):
        param.normal_()


def test_piece_bytes_below_one_element_is_refused():
    with pytest.raises(ValueError, match="piece_bytes >= 8"):
        RandomFillsOnDevice(torch.device("cpu"), piece_bytes=4)


def offload_config() -> dict:
    return ds_config(bf16={"enabled": True}, gradient_clipping=1.0,
                     zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}},
                     zero_cache={"enabled": True, "chunk_size": 8192, "device_memory_budget": "1GiB",
                                 "host_memory_budget": "1GiB"})


def test_zero_init_draws_on_the_gpu_only_when_building_on_the_host_with_one_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert angelptm.zero.Init(remote_device="cpu").fills is None  # no GPU: nothing changes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert angelptm.zero.Init(remote_device="cpu").fills.device == torch.device("cuda", 0)
    assert angelptm.zero.Init(config_dict_or_path=offload_config()).fills.device == torch.device("cuda", 0)
    assert angelptm.zero.Init().fills is None  # built on the GPU: its fills are there already


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_a_model_built_under_zero_init_with_device_fills_trains(flavour):
    model_config = ModelConfig(flavour=flavour, vocab_size=VOCAB, max_seq_len=SEQ, num_layers=2, hidden_size=32,
                               num_heads=4, tie_embeddings=flavour == "gpt2")
    config = offload_config()
    init = angelptm.zero.Init(config_dict_or_path=config, remote_device="cpu")
    init.fills = fills()  # "cpu" stands for the GPU; pieces small enough for a model this size
    with init:
        torch.manual_seed(0)
        model = build_model(model_config)
    weights = [p for p in model.parameters() if p.numel() >= MIN_NUMEL]
    assert weights and init.fills.pieces_filled >= sum(pieces_of(p) for p in weights)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32
    engine, *_ = angelptm.initialize(model=model, config=config)
    losses = train_steps(engine, random_batches(0, count=4, batch=2))
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


@pytest.mark.gpu
def test_on_a_gpu_the_device_holds_one_piece_at_most():
    weight = torch.empty(4096, 4096, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with RandomFillsOnDevice(torch.device("cuda"), piece_bytes=4 << 20) as mode:
        nn.init.normal_(weight, std=0.02)
    assert mode.pieces_filled == 8 and torch.cuda.max_memory_allocated() - before <= 4 << 20
    assert weight.float().std().item() == pytest.approx(0.02, rel=0.03)


def test_zero_init_reads_a_configs_batch_triple_with_the_launchers_world_size(monkeypatch):
    """Under torchrun, train_batch_size counts every rank: zero.Init must resolve it as initialize() does."""
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert angelptm.zero.Init(config_dict_or_path=config).dtype == torch.float32
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(angelptm.ConfigError, match="inconsistent batch sizes"):
        angelptm.zero.Init(config_dict_or_path=config)
