"""The engine against plain PyTorch training loops written out by hand, on fresh random inputs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, reference_loop, tiny_gpt, train_steps
from torch import nn

import angelptm


def engine_loop(model: nn.Module, batches: list[dict], config: dict) -> tuple[list[float], angelptm.Engine]:
    engine, _, _, _ = angelptm.initialize(model=model, config=config)
    return train_steps(engine, batches), engine


@pytest.mark.parametrize("dtype_key,dtype", [("bf16", torch.bfloat16), (None, torch.float32)])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_engine_equals_hand_written_mixed_precision_loop(dtype_key, dtype, accumulation):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4 * accumulation, batch=4)
    config = ds_config(gradient_accumulation_steps=accumulation, gradient_clipping=0.5)
    if dtype_key:
        config[dtype_key] = {"enabled": True}
    # Llama flavour: GPT-2's key bias has an identically-zero true gradient, so Adam turns float
    # noise there into full-lr steps and no two summation orders would agree.
    ref_losses, ref_masters = reference_loop(tiny_gpt(seed, "llama"), batches, dtype=dtype,
                                             accumulation=accumulation, lr=3e-3, clip=0.5, deepspeed_adam=True)
    losses, engine = engine_loop(tiny_gpt(seed, "llama"), batches, config)
    assert engine.global_steps == 4
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    masters = engine.optimizer.master_state_dict()
    initial = dict(tiny_gpt(seed, "llama").named_parameters())
    for name, expected in ref_masters.items():
        assert not torch.equal(expected, initial[name].detach()), f"{name} never moved; the test would be vacuous"
        torch.testing.assert_close(masters[name], expected, rtol=1e-6, atol=1e-7)
    for name, param in engine.module.named_parameters():
        assert param.dtype == dtype
        torch.testing.assert_close(param.float(), masters[name].to(dtype).float(), rtol=0, atol=0)


def test_bf16_engine_tracks_fp32_autocast_training():
    """bf16 weights + fp32 masters stay within bf16 noise of PyTorch's own autocast recipe (fp32 weights)."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=12, batch=8)
    model = tiny_gpt(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    autocast_losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        autocast_losses.append(loss.item())
    losses, _ = engine_loop(tiny_gpt(seed), batches, ds_config(bf16={"enabled": True}))
    assert autocast_losses[-1] < autocast_losses[0] - 0.1, "the reference must actually learn"
    assert losses == pytest.approx(autocast_losses, rel=2e-2)


def test_fp16_overflow_skips_step_and_lowers_scale(caplog):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=3, batch=4)
    # 2**40 times a loss of ~4 overflows fp16 (max 65504) in every gradient.
    config = ds_config(fp16={"enabled": True, "initial_scale_power": 40, "hysteresis": 1})
    engine, _, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=config)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="angelptm.engine.engine"):
        loss = engine(**batches[0])
        engine.backward(loss)
        engine.step()
    assert not engine.was_step_applied()
    assert engine.skipped_steps == 1 and engine.global_steps == 1
    assert engine.loss_scale == 2.0**39
    assert any("overflow" in record.message for record in caplog.records)
    for name, param in engine.module.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed on a skipped step"
    engine.optimizer.loss_scaler.cur_scale = 2.0**8  # a workable scale: the next step must apply
    loss = engine(**batches[1])
    engine.backward(loss)
    engine.step()
    assert engine.was_step_applied()
    assert any(not torch.equal(p, before[n]) for n, p in engine.module.named_parameters())


def test_fp16_engine_learns_like_fp32():
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=10, batch=8)
    fp32_losses, _ = engine_loop(tiny_gpt(seed), batches, ds_config())
    fp16_losses, engine = engine_loop(tiny_gpt(seed), batches, ds_config(fp16={"enabled": True}))
    assert engine.skipped_steps == 0
    assert fp16_losses == pytest.approx(fp32_losses, rel=2e-2)


def test_hugging_face_model_trains_through_the_engine():
    transformers = pytest.importorskip("transformers")
    seed = torch.randint(0, 10_000, ()).item()
    torch.manual_seed(seed)
    hf_config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(hf_config)
    reference = copy.deepcopy(model)
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=ds_config(bf16={"enabled": True}))
    batches = random_batches(seed, count=8, batch=4)
    losses = []
    for batch in batches:
        output = engine(input_ids=batch["input_ids"], labels=batch["input_ids"])  # HF shifts labels itself
        engine.backward(output.loss)
        engine.step()
        losses.append(output.loss.item())
    ref_losses = []
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(ref_losses, rel=3e-2)
    exported = engine.consolidated_state_dict()
    fresh = transformers.GPT2LMHeadModel(hf_config)
    fresh.load_state_dict(exported)
    torch.testing.assert_close(fresh.transformer.wte.weight,
                               engine.optimizer.master_state_dict()["transformer.wte.weight"])


def test_step_without_optimizer_explains():
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(0), config={"train_batch_size": 4})
    assert optimizer is None
    loss = engine(**random_batches(0, 1, 4)[0])
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="optimizer"):
        engine.step()


def test_client_optimizer_and_scheduler_callable():
    model = tiny_gpt(1)
    client = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, optimizer, _, scheduler = angelptm.initialize(
        model=model, optimizer=client, config={"train_batch_size": 4},
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert optimizer is client and engine.optimizer.optimizer is client  # DeepSpeed returns the client's (fp32, ZeRO 0)
    for batch in random_batches(1, 3, 4):
        engine.backward(engine(**batch))
        engine.step()
    assert engine.get_lr() == [pytest.approx(1e-3 * 0.5**3)]


def test_accumulation_boundary_follows_deepspeed():
    engine, _, _, _ = angelptm.initialize(model=tiny_gpt(2), config=ds_config(gradient_accumulation_steps=3))
    boundaries = []
    for batch in random_batches(2, 6, 4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(**batch))
        engine.step()
    assert boundaries == [False, False, True, False, False, True]
    assert engine.global_steps == 2 and engine.train_batch_size() == 12


def test_csv_monitor_records_every_step(tmp_path):
    config = ds_config(gradient_accumulation_steps=2,
                       csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "run"})
    batches = random_batches(4, 6, 4)
    losses, engine = engine_loop(tiny_gpt(4), batches, config)
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,name,value"
    logged = {}
    for row in rows[1:]:
        step, name, value = row.split(",")
        logged[(int(step), name)] = float(value)
    for step in (1, 2, 3):
        expected = (losses[2 * step - 2] + losses[2 * step - 1]) / 2
        assert logged[(step, "loss")] == pytest.approx(expected, rel=1e-6)
        assert logged[(step, "lr")] == pytest.approx(3e-3)
        assert logged[(step, "samples")] == 8 * step


def test_deepspeed_api_details():
    """Behaviours a DeepSpeed script relies on (each checked against DeepSpeed 0.19.8 in review)."""
    torch.manual_seed(42)
    expected_next = torch.rand(1)
    torch.manual_seed(42)
    engine, _, _, _ = angelptm.initialize(model=tiny_gpt(5), config=ds_config(gradient_accumulation_steps=2))
    # initialize() leaves the caller's RNG alone when the config sets no "seed" ...
    torch.manual_seed(42)
    assert torch.equal(torch.rand(1), expected_next)
    batch = random_batches(5, 1, 4)[0]
    loss = engine(**batch)
    returned = engine.backward(loss)
    assert returned.item() == pytest.approx(loss.item() / 2)  # ... backward returns loss / gas ...
    assert engine.optimizer.flat_grad.abs().sum() > 0
    engine.zero_grad()  # ... zero_grad drops the accumulated sum ...
    assert engine.optimizer.flat_grad.abs().sum() == 0
    engine.step()
    assert not engine.was_step_applied()  # ... and a non-boundary step is not an applied step.
    engine.backward(engine(**batch))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1


def test_non_finite_bf16_gradients_skip_the_step():
    engine, _, _, _ = angelptm.initialize(model=tiny_gpt(6), config=ds_config(bf16={"enabled": True}))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    loss = engine(**random_batches(6, 1, 4)[0])
    engine.backward(loss * float("nan"))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())


def test_frozen_parameters_and_namedtuple_inputs():
    import collections

    Batch = collections.namedtuple("Batch", "x y")

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(3, 3)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(3, 1)

        def forward(self, batch):
            return ((self.head(self.frozen(batch.x)) - batch.y) ** 2).mean()

    model = Regressor()
    frozen_before = model.frozen.weight.detach().clone()
    config = ds_config(fp16={"enabled": True, "auto_cast": True, "initial_scale_power": 8})
    engine, _, _, _ = angelptm.initialize(model=model, model_parameters=model.parameters(), config=config)
    head_before = engine.module.head.weight.detach().clone()
    x = torch.randn(4, 3)
    engine.backward(engine(Batch(x, x.sum(1, keepdim=True))))  # auto_cast: fp32 inputs reach the fp16 model
    engine.step()
    assert torch.equal(engine.module.frozen.weight.float(), frozen_before.half().float())
    assert not torch.equal(engine.module.head.weight, head_before)
