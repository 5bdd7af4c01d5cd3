"""``angelptm.initialize``'s arguments, checked at the door.

``model="gpt2"``, ``config=123`` and ``config=[1, 2]`` used to end in tracebacks from inside (``'str' object has no
attribute 'named_parameters'``, ``expected str, bytes or os.PathLike object, not int``); ``model_parameters`` of
plain tensors, or a model whose parameters are all frozen, were accepted and nothing ever trained. Each is now
refused naming the argument, its type and what is allowed.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

import angelptm
from angelptm.errors import ArgumentTypeError, ConfigError

CONFIG = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
ZERO_CACHE = {**CONFIG, "zero_cache": {"enabled": True, "chunk_size": 4096}}


def frozen(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module


@pytest.mark.parametrize("kwargs, named", [
    ({"model": "gpt2"}, ("model", "str", "'gpt2'", "torch.nn.Module")),
    ({"model": nn.Linear(2, 2), "config": 123}, ("config", "int", "123", "a path", "a dict")),
    ({"model": nn.Linear(2, 2), "config": [1, 2]}, ("config", "list", "[1, 2]", "a path", "a dict")),
    ({"model": nn.Linear(2, 2), "config": b"{}"}, ("config", "bytes")),
    ({"model": nn.Linear(2, 2), "config_params": 1.5}, ("config_params", "float")),
    ({"model": nn.Linear(2, 2), "args": argparse.Namespace(deepspeed_config=7)}, ("args.deepspeed_config", "int")),
    ({"model": nn.Linear(2, 2), "config": CONFIG, "optimizer": "adam"}, ("optimizer", "str", "torch.optim.Optimizer")),
    ({"model": nn.Linear(2, 2), "config": CONFIG, "model_parameters": 5}, ("model_parameters", "int", "iterable")),
    ({"model": nn.Linear(2, 2), "config": CONFIG, "model_parameters": torch.zeros(2, requires_grad=True)},
     ("model_parameters", "Tensor", "a list")),
])
def test_an_argument_of_the_wrong_type_is_named_with_its_type_and_what_is_allowed(kwargs, named):
    with pytest.raises(ArgumentTypeError) as info:
        angelptm.initialize(**kwargs)
    message = str(info.value)
    assert all(text in message for text in named), message
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)  # either catch works


def trains(engine, model: nn.Linear) -> bool:
    before = model.weight.detach().clone()
    engine.backward(engine(torch.ones(2, 2)).sum())
    engine.step()
    return not torch.equal(before, model.weight)


@pytest.mark.parametrize("given", ["named_parameters", "group of named parameters"])
def test_named_parameters_train_as_torch_optimizers_take_them(given):
    model = nn.Linear(2, 2)
    params = (model.named_parameters() if given == "named_parameters"
              else [{"params": model.named_parameters(), "lr": 0.5}])
    engine, *_ = angelptm.initialize(model=model, config=CONFIG, model_parameters=params)
    assert sum(len(g["params"]) for g in engine.optimizer.optimizer.param_groups) == 2
    assert trains(engine, model)


def test_an_optimizer_object_ignores_model_parameters_whatever_they_hold():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = angelptm.initialize(model=model, config={"train_batch_size": 2}, optimizer=optimizer,
                                     model_parameters=model.named_parameters())
    assert trains(engine, model)


@pytest.mark.parametrize("config", [CONFIG, ZERO_CACHE], ids=["plain", "zero_cache"])
@pytest.mark.parametrize("params", ["plain tensor", "frozen plain tensor", "empty", "frozen parameter",
                                    "group of plain tensors"])
def test_model_parameters_without_a_trainable_parameter_of_the_model_are_refused(config, params):
    model = nn.Linear(64, 64)
    given = {"plain tensor": [torch.zeros(2, requires_grad=True)], "frozen plain tensor": [torch.zeros(2)],
             "empty": [], "frozen parameter": [frozen(nn.Linear(2, 2)).weight],
             "group of plain tensors": [{"params": [torch.zeros(2, requires_grad=True)], "lr": 1e-3}]}[params]
    with pytest.raises(ConfigError) as info:
        angelptm.initialize(model=model, config=config, model_parameters=given)
    message = str(info.value)
    assert "model_parameters holds no trainable parameter of the model" in message, message
    assert "model.parameters()" in message


@pytest.mark.parametrize("path", ["plain", "zero_cache", "callable optimizer", "optimizer object", "pipeline"])
def test_a_model_whose_parameters_are_all_frozen_is_refused_on_every_path(path):
    model = frozen(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)))
    kwargs = {"model": model, "config": ZERO_CACHE if path == "zero_cache" else CONFIG}
    if path == "callable optimizer":
        kwargs["optimizer"] = lambda params: torch.optim.SGD(params, lr=0.1)
    elif path == "optimizer object":
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    elif path == "pipeline":
        kwargs["model"] = angelptm.pipe.PipelineModule(list(model), num_stages=1, loss_fn=nn.MSELoss())
    with pytest.raises(ConfigError) as info:
        angelptm.initialize(**kwargs)
    message = str(info.value)
    assert "no trainable parameter" in message and "requires_grad" in message, message


def test_frozen_and_trainable_parameters_together_still_train():
    model = nn.Sequential(frozen(nn.Linear(2, 2)), nn.Linear(2, 2))
    engine, *_ = angelptm.initialize(model=model, config=CONFIG, model_parameters=model.parameters())
    before = model[1].weight.detach().clone()
    loss = engine(torch.ones(2, 2)).sum()
    engine.backward(loss)
    engine.step()
    assert not torch.equal(before, model[1].weight)


def test_a_frozen_model_without_an_optimizer_is_fine_for_inference():
    model = frozen(nn.Linear(2, 2))
    engine, optimizer, *_ = angelptm.initialize(model=model, config={"train_batch_size": 2})
    assert optimizer is None and engine(torch.ones(1, 2)).shape == (1, 2)


def test_param_groups_given_as_generators_are_read_once_and_still_train():
    model = nn.Linear(2, 2)
    groups = [{"params": (p for p in model.parameters()), "lr": 0.5}]
    engine, *_ = angelptm.initialize(model=model, config=CONFIG, model_parameters=groups)
    assert sum(len(g["params"]) for g in engine.optimizer.optimizer.param_groups) == 2


@pytest.mark.parametrize("config", [123, [1, 2], b"{}"])
def test_load_config_names_a_config_of_the_wrong_type(config):
    from angelptm.config import load_config

    with pytest.raises(ArgumentTypeError, match=rf"config: got {type(config).__name__} .*a path .*or a dict"):
        load_config(config)
