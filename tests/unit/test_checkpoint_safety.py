"""Checkpoint safety (issue 38): the unpickling allowlist, paths that stay inside a checkpoint, reserved tags,
one writer per save_dir, and an export that never writes into a checkpoint."""

from __future__ import annotations

import argparse
import builtins
import cProfile
import io
import os
import pydoc
import subprocess
import timeit
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import angelptm
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import manifest as checkpoint_manifest
from angelptm.checkpoints import safe_pickle
from angelptm.pretraining.models import ModelConfig, build_model


def gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(vocab_size=64, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=4))


def engine(seed: int = 0, **extra):
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra}
    return angelptm.initialize(model=gpt(seed), config=config)[0]


def one_step(engine_) -> None:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = engine_.module(tokens).float().mean()
    engine_.backward(loss)
    engine_.step()


CLIENT_STATE = {"epoch": 3, "lr": 1e-3, "name": "run", "flags": [True, None], "shape": (2, 3), "ids": {1, 2},
                "raw": b"\x00\x01", "nested": {"t": torch.arange(3), "f16": torch.ones(2, dtype=torch.float16)}}


def saved_globals(root: Path) -> set[str]:
    return {name for path in root.rglob("*.pt") for name in safe_pickle.pickle_globals(path)}


def test_the_allowlist_covers_what_each_kind_of_checkpoint_names(tmp_path):
    """Plain (fp32, bf16), ZeRO-Cache and pipeline checkpoints with every RNG state and a client_state of plain
    types name only allowlisted globals, and load back."""
    found: set[str] = set()
    kinds = {"plain": {}, "bf16": {"bf16": {"enabled": True}},
             "zero_cache": {"zero_cache": {"enabled": True, "chunk_size": 4096}}}
    for kind, extra in kinds.items():
        source = engine(**extra)
        one_step(source)
        source.save_checkpoint(tmp_path / kind, client_state=CLIENT_STATE)
        found |= saved_globals(tmp_path / kind)
        _, client = engine(**extra).load_checkpoint(tmp_path / kind)
        assert client["ids"] == {1, 2} and torch.equal(client["nested"]["t"], torch.arange(3))
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]
    pipe = angelptm.pipe.PipelineModule(layers, num_stages=1, loss_fn=nn.MSELoss())
    pipe_engine, *_ = angelptm.initialize(model=pipe, model_parameters=pipe.parameters(), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    pipe_engine.save_checkpoint(tmp_path / "pipe", client_state=CLIENT_STATE)
    found |= saved_globals(tmp_path / "pipe")
    assert "torch._utils._rebuild_tensor_v2" in found and "collections.OrderedDict" in found
    assert found <= safe_pickle.ENGINE_GLOBALS, found - safe_pickle.ENGINE_GLOBALS


class Calls:
    """Unpickling this calls ``function(*args)``: the stand-in for any code an attacker wants run."""

    def __init__(self, function, *args) -> None:
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def hostile_payloads(marker: Path) -> dict[str, Calls]:
    """Each would create ``marker`` if it ran."""
    code = f"open({str(marker)!r}, 'w').close()"
    return {"timeit": Calls(timeit.timeit, code, "pass", timeit.default_timer, 1),
            "pipepager": Calls(pydoc.pipepager, "text", f"touch {marker}"),
            "cProfile": Calls(cProfile.run, code), "io.open": Calls(io.open, str(marker), "w"),
            "os.system": Calls(os.system, f"touch {marker}"), "eval": Calls(builtins.eval, code),
            "exec": Calls(builtins.exec, code), "subprocess.run": Calls(subprocess.run, ["touch", str(marker)]),
            "subprocess.Popen": Calls(subprocess.Popen, ["touch", str(marker)])}


@pytest.mark.parametrize("opt_in", [False, True])
def test_code_running_globals_are_refused_by_name_in_both_modes_and_nothing_runs(tmp_path, opt_in):
    marker = tmp_path / "pwned"
    for name, payload in hostile_payloads(marker).items():
        path = tmp_path / f"{name}.pt"
        torch.save({"module": {}, "x": payload}, path)
        with pytest.raises(angelptm.CheckpointError) as refused:
            safe_pickle.load(path, allow_unsafe_pickle=opt_in)
        message = str(refused.value)
        named = f"{payload.function.__module__}.{payload.function.__qualname__}"
        assert f"names {named}" in message and "which no checkpoint of this engine holds" in message, (name, message)
        assert "nothing in it ran" in message and "numpy RNG" not in message and "opt in with" not in message
    assert not marker.exists()


def test_the_opt_in_admits_numpy_arrays_and_namespaces_only(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"keys": np.arange(4, dtype=np.uint32), "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(angelptm.CheckpointError, match=r"numpy arrays, as checkpoints of the previous format hold "
                                                       r"numpy's RNG state.*allow_unsafe_pickle=True"):
        safe_pickle.load(path)
    loaded = safe_pickle.load(path, allow_unsafe_pickle=True)
    assert loaded["keys"].tolist() == [0, 1, 2, 3] and loaded["args"].lr == 0.1
    torch.save({"args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(angelptm.CheckpointError, match=r"holds an argparse.Namespace \(argparse.Namespace\)"):
        safe_pickle.load(path)


def test_saving_an_object_loading_would_refuse_is_refused_at_the_save(tmp_path):
    with pytest.raises(angelptm.CheckpointError, match=r"argparse.Namespace.*vars\(args\)"):
        engine().save_checkpoint(tmp_path, client_state={"args": argparse.Namespace(lr=0.1)})
    assert not (tmp_path / "latest").exists()
