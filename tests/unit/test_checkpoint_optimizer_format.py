"""Issue 38: a checkpoint saved with ZeRO-Cache resumes with it off, and the reverse (both once died with
``KeyError: 'params'`` / ``'step'``). Masters and Adam moments map 1:1 by parameter name, so the optimizer states
are converted exactly; what cannot be converted exactly is refused by name."""

from __future__ import annotations

import pytest
import torch
from reference import ds_config, random_batches, train_steps
from zero_cache_setup import FP32_BYTES_PER_ELEMENT, budgets, six_layer_llama, zero_cache_config

import angelptm
from angelptm.checkpoints.optimizer_format import to_plain, to_zero_cache
from angelptm.errors import CheckpointError

SEED = 7


def fp32_engine(zero_cache: bool) -> angelptm.Engine:
    if zero_cache:
        config = zero_cache_config(*budgets(six_layer_llama(SEED), FP32_BYTES_PER_ELEMENT))
        del config["bf16"]
    else:
        config = ds_config(gradient_clipping=1.0)
    engine, _, _, _ = angelptm.initialize(model=six_layer_llama(SEED), config=config)
    return engine


def named_moments(engine: angelptm.Engine) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, {"exp_avg/NAME" or "exp_avg_sq/NAME": the state, shaped}) of either optimizer."""
    state = engine.optimizer.state_dict()["optimizer"]
    masters = engine.optimizer.master_state_dict()
    if "state" in state:  # plain: torch's, by index in the optimizer's name order
        names = engine.optimizer.names
        steps = {int(s["step"]) for s in state["state"].values()}
        assert len(steps) == 1
        return steps.pop(), {f"{f}/{names[i]}": s[f] for i, s in state["state"].items()
                             for f in ("exp_avg", "exp_avg_sq")}
    return state["step"], {f"{f}/{n}": state[f][n].view(masters[n].shape) for n in masters
                           for f in ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("saved_with, resumed_with", [(False, True), (True, False)],
                         ids=["plain-to-zero-cache", "zero-cache-to-plain"])
def test_a_checkpoint_resumes_exactly_with_zero_cache_switched(tmp_path, saved_with, resumed_with):
    batches = random_batches(SEED, count=4, batch=4)
    saved = fp32_engine(saved_with)
    train_steps(saved, batches[:3])
    saved.save_checkpoint(str(tmp_path))
    step, moments = named_moments(saved)
    masters = saved.optimizer.master_state_dict()

    resumed = fp32_engine(resumed_with)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.global_steps == 3
    resumed_step, resumed_moments = named_moments(resumed)
    assert resumed_step == step == 3 and resumed_moments.keys() == moments.keys()
    for key, value in moments.items():
        assert value.abs().max() > 0, f"{key} is all zeros: the comparison would prove nothing"
        assert torch.equal(resumed_moments[key].reshape(value.shape), value), key
    for name, master in resumed.optimizer.master_state_dict().items():
        assert torch.equal(master, masters[name]), name
    # The next step goes on as the saved run's own would (the engines round differently: fused vs foreach Adam).
    assert train_steps(resumed, batches[3:]) == pytest.approx(train_steps(saved, batches[3:]), rel=1e-5)


def test_weights_only_load_across_the_switch_starts_the_optimizer_afresh(tmp_path):
    saved = fp32_engine(True)
    train_steps(saved, random_batches(SEED, count=2, batch=4))
    saved.save_checkpoint(str(tmp_path))
    resumed = fp32_engine(False)
    resumed.load_checkpoint(str(tmp_path), load_optimizer_states=False)
    initial = dict(six_layer_llama(SEED).named_parameters())
    for name, master in saved.optimizer.master_state_dict().items():
        assert not torch.equal(master, initial[name].detach()), f"{name} never moved"
        assert torch.equal(resumed.optimizer.master_state_dict()[name], master), name
    assert resumed.optimizer.state_dict()["optimizer"]["state"] == {}


def test_moments_of_unequal_steps_or_missing_are_refused_by_name():
    masters = {"a": torch.ones(2), "b": torch.ones(3)}
    plain = {"optimizer": {"state": {i: {"step": torch.tensor(step), "exp_avg": masters[n], "exp_avg_sq": masters[n]}
                                     for i, (n, step) in enumerate([("a", 3.0), ("b", 2.0)])},
                           "param_groups": [{"lr": 1e-3, "params": [0, 1]}]},
             "masters": masters, "loss_scaler": None}
    with pytest.raises(CheckpointError, match=r"ckpt: .*steps \[2, 3\].*load_optimizer_states=False"):
        to_zero_cache(plain, "ckpt")
    del plain["optimizer"]["state"][1]
    with pytest.raises(CheckpointError, match=r"ckpt: .*no Adam state for b.*load_optimizer_states=False"):
        to_zero_cache(plain, "ckpt")


def test_a_zero_cache_state_with_other_param_groups_is_refused_by_name():
    saved = {"optimizer": {"step": 2, "param_groups": [{"lr": 1e-3}, {"lr": 1e-3}], "exp_avg": {"a": torch.ones(2)},
                           "exp_avg_sq": {"a": torch.ones(2)}},
             "masters": {"a": torch.ones(2)}, "loss_scaler": None}
    with pytest.raises(CheckpointError, match=r"ckpt: .*2 parameter groups.*this run has 1"):
        to_plain(saved, "ckpt", names=["a"], param_groups=[{"lr": 1e-3, "params": [0]}])
