"""``engine.destroy()`` (DeepSpeed's; accelerate's ``free_memory()`` and so a second ``Trainer.train()`` call it):
the module keeps its current weights as ordinary tensors, the hooks come off, the optimizer's storage, swap files
and worker thread are released now, and a new engine over the same module trains on from those weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import angelptm
from reference import ds_config, open_files_under, random_batches, train_steps
from test_zero_cache_nvme_homes import config as homes_config
from test_zero_cache_nvme_homes import tiny_gpt


def engine_config(kind: str, swap: Path) -> dict:
    """"nvme"/"host": gathered params streamed from their home (placeholders between uses); "auto": replicated
    params on the device tier, optimizer groups split with the host; "replicated": no ZeRO-Cache."""
    if kind == "replicated":
        return ds_config(gradient_clipping=1.0)
    config = homes_config(kind, swap if kind == "nvme" else None)
    if kind == "auto":
        config["zero_cache"]["device_memory_budget"] = 600_000  # about half the model states
    return config


def hooks_left(model: torch.nn.Module) -> int:
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return modules + sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


@pytest.mark.parametrize("kind", ["nvme", "host", "auto", "replicated"])
def test_destroy_hands_the_module_its_weights_and_releases_the_rest(tmp_path, kind):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=2)
    model = tiny_gpt(seed)
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=engine_config(kind, tmp_path))
    zero_cache = kind != "replicated"
    if zero_cache:
        groups = {str(group.tier) for group in optimizer.store.groups}
        assert optimizer.store.shard_params == (kind in ("nvme", "host")) and ("host" in groups)
    train_steps(engine, batches[:2])
    trained = engine.consolidated_state_dict()
    assert hooks_left(model) > 0
    if kind == "nvme":
        assert open_files_under(tmp_path) > 0

    engine.destroy()
    engine.destroy()  # a second call does nothing
    assert engine.destroyed and hooks_left(model) == 0
    gathered = kind in ("nvme", "host")  # whole tensors of their own now, not placeholders; the others keep the
    for name, param in model.named_parameters():  # views of their chunk (or their own tensors) they had
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size() or not gathered
        assert torch.equal(param.detach(), trained[name]), name
    if zero_cache:
        assert not optimizer.host._thread.is_alive() and optimizer.store.groups == []
        assert open_files_under(tmp_path) == 0, "the swap files are closed at destroy(), not at exit"
    else:
        assert optimizer.masters == [] and not optimizer.optimizer.state
    with pytest.raises(RuntimeError, match=r"engine.step\(\) after engine.destroy\(\)"):
        engine.step()
    with pytest.raises(RuntimeError, match="save_checkpoint"):  # the optimizer's states are gone: nothing to save
        engine.save_checkpoint(str(tmp_path / "checkpoints"))

    # A new engine over the same module trains on from the handed-back weights, as one built from them would.
    again, _, _, _ = angelptm.initialize(model=model, config=engine_config(kind, tmp_path))
    fresh = tiny_gpt(seed)
    fresh.load_state_dict(trained)
    reference, _, _, _ = angelptm.initialize(model=fresh, config=engine_config(kind, tmp_path))
    assert train_steps(again, batches[2:]) == train_steps(reference, batches[2:])
