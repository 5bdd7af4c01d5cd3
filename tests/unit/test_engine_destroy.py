"""``engine.destroy()`` (DeepSpeed's; accelerate's ``free_memory()`` and so a second ``Trainer.train()`` call it):
the module keeps its current weights as ordinary tensors, the hooks come off, the optimizer's storage, swap files
and worker thread are released now, and a new engine over the same module trains on from those weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import ds_config, open_files_under, random_batches, train_steps
from test_zero_cache_nvme import nvme_config, six_layer_llama
from test_zero_cache_nvme_homes import config as homes_config
from test_zero_cache_nvme_homes import tiny_gpt

import angelptm

KINDS = ["nvme", "host", "auto", "three_tiers", "replicated"]
""""nvme"/"host": gathered params streamed from their home (placeholders between uses); "auto": replicated params
on the device tier, optimizer groups split with the host; "three_tiers": groups on the device, the host and the
disk; "replicated": no ZeRO-Cache."""
GATHERED = ("nvme", "host")


def built(kind: str, seed: int, swap: Path) -> tuple[torch.nn.Module, dict]:
    """A model and config of ``kind`` (the same model and config for the same seed)."""
    if kind == "three_tiers":
        return six_layer_llama(seed), nvme_config(swap, seed)[0]
    if kind == "replicated":
        return tiny_gpt(seed), ds_config(gradient_clipping=1.0)
    config = homes_config(kind, swap if kind == "nvme" else None)
    if kind == "auto":
        config["zero_cache"]["device_memory_budget"] = 600_000  # about half the model states
    return tiny_gpt(seed), config


def hooks_left(model: torch.nn.Module) -> int:
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return modules + sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_destroy_hands_the_module_its_weights_and_releases_the_rest(tmp_path, kind):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=2)
    model, config = built(kind, seed, tmp_path)
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config)
    zero_cache = kind != "replicated"
    if zero_cache:
        groups = {str(group.tier) for group in optimizer.store.groups}
        assert optimizer.store.shard_params == (kind in GATHERED)
        assert groups == ({"device", "host", "nvme"} if kind == "three_tiers" else {"host"} if kind in GATHERED
                          else {"device", "host"})
    train_steps(engine, batches[:2])
    trained = engine.consolidated_state_dict()
    assert hooks_left(model) > 0
    if kind in ("nvme", "three_tiers"):
        assert open_files_under(tmp_path) > 0

    engine.destroy()
    engine.destroy()  # a second call does nothing
    assert engine.destroyed and optimizer.destroyed and hooks_left(model) == 0
    for name, param in model.named_parameters():  # gathered ones: whole tensors of their own in host memory now,
        assert torch.equal(param.detach(), trained[name].to(param.dtype)), name  # not placeholders; the others
        # keep their storage (in the compute dtype: the fp32 masters were released)
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size() or kind not in GATHERED
    if zero_cache:
        assert not optimizer.host._thread.is_alive() and optimizer.store.groups == []
        assert open_files_under(tmp_path) == 0, "the swap files are closed at destroy(), not at exit"
    else:
        assert optimizer.masters == [] and not optimizer.optimizer.state
    for call in (lambda: engine.step(), lambda: engine(**batches[2]), lambda: engine.save_checkpoint(str(tmp_path))):
        with pytest.raises(RuntimeError, match=r"after engine.destroy\(\)"):
            call()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) after engine.destroy\(\)"):
        optimizer.step()
    engine.save_16bit_model(str(tmp_path / "saved"))  # the module's own weights now
    saved = torch.load(tmp_path / "saved" / "pytorch_model.bin")
    assert all(torch.equal(saved[name], value.to(saved[name].dtype)) for name, value in trained.items())

    # A new engine over the same module trains on from the handed-back weights, as one built from them would.
    again, _, _, _ = angelptm.initialize(model=model, config=built(kind, seed, tmp_path)[1])
    fresh, config = built(kind, seed, tmp_path)
    fresh.load_state_dict(trained)
    reference, _, _, _ = angelptm.initialize(model=fresh, config=config)
    assert train_steps(again, batches[2:]) == train_steps(reference, batches[2:])


@pytest.mark.parametrize("kind", ["auto", "nvme", "replicated"])
def test_destroy_between_backward_and_step_hands_back_the_weights_before_that_backward(tmp_path, kind):
    """One micro-batch per step writes gradients over the params (or into their homes), and host chunks update
    during backward: destroy() drops that window first, as zero_grad() does, so what comes back is the weights, not
    gradients or half of an update (accelerate's free_memory() after an out-of-memory error in backward gets here)."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=3, batch=2)
    model, config = built(kind, seed, tmp_path)
    engine, _, _, _ = angelptm.initialize(model=model, config=config)
    train_steps(engine, batches[:2])
    trained = engine.consolidated_state_dict()
    engine.backward(engine(**batches[2]))
    engine.destroy()
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), trained[name].to(param.dtype)), name
