"""Both engine optimizers satisfy :class:`angelptm.engine.optimizer_contract.EngineOptimizer`: every member is there,
each method with a signature the engine's calls fit, each property a property, and each data attribute set on a
built optimizer. A member renamed or dropped on either side fails here, not in a ``getattr`` default."""

from __future__ import annotations

import inspect
import typing
from typing import Any, Protocol

import pytest
import torch
from reference import ds_config
from test_zero_cache_nvme_homes import config as zero_cache_config
from test_zero_cache_nvme_homes import tiny_gpt

import angelptm
from angelptm.engine.mixed_precision import MixedPrecisionOptimizer
from angelptm.engine.optimizer_contract import EngineOptimizer, ExpertStateOptimizer
from zero_cache import Sharding, Timeline, ZeroCacheOptimizer

IMPLEMENTATIONS = {"replicated": MixedPrecisionOptimizer, "zero_cache": ZeroCacheOptimizer}


def contract_members(protocol: type) -> dict[str, Any]:
    """Name -> what the protocol declares: a function, a property, or (for a data attribute) its annotation."""
    members: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, Protocol, typing.Generic) or not getattr(klass, "_is_protocol", False):
            continue
        members.update({name: annotation for name, annotation in klass.__dict__.get("__annotations__", {}).items()})
        members.update({name: value for name, value in vars(klass).items()
                        if not name.startswith("_") and (callable(value) or isinstance(value, property))})
    return members


def signature_problems(protocol: type, cls: type) -> list[str]:
    """What of ``protocol``'s methods and properties ``cls`` lacks or declares incompatibly (data attributes are set
    in ``__init__``: :func:`test_a_built_optimizer_of_each_kind_is_an_engine_optimizer` checks those)."""
    problems = []
    for name, declared in contract_members(protocol).items():
        found = inspect.getattr_static(cls, name, None)
        if isinstance(declared, property):
            if not isinstance(found, property):
                problems.append(f"{cls.__name__}.{name}: not a property")
        elif callable(declared):
            if not callable(found):
                problems.append(f"{cls.__name__}.{name}: missing")
            else:
                problems += [f"{cls.__name__}.{name}: {problem}"
                             for problem in _call_problems(inspect.signature(declared), inspect.signature(found))]
    return problems


def _call_problems(declared: inspect.Signature, found: inspect.Signature) -> list[str]:
    """Every call the declared signature allows must fit ``found``: each parameter there, of the same kind and
    default; a parameter only ``found`` has must have a default."""
    problems = []
    wanted = dict(declared.parameters)
    for name, param in found.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name not in wanted:
            if param.default is param.empty:
                problems.append(f"takes {name!r}, which the contract does not pass")
            continue
        want = wanted.pop(name)
        if want.kind != param.kind:
            problems.append(f"{name!r} is {param.kind.description}, the contract's is {want.kind.description}")
        elif want.default != param.default:
            problems.append(f"{name!r} defaults to {param.default!r}, the contract's to {want.default!r}")
    problems += [f"lacks {name!r}" for name in wanted]
    return problems


@pytest.mark.parametrize("kind", sorted(IMPLEMENTATIONS))
def test_every_contract_method_and_property_is_on_both_optimizers(kind: str) -> None:
    assert signature_problems(EngineOptimizer, IMPLEMENTATIONS[kind]) == []


def test_the_expert_slices_are_the_replicated_optimizers() -> None:
    assert signature_problems(ExpertStateOptimizer, MixedPrecisionOptimizer) == []


def test_a_renamed_or_changed_member_is_reported() -> None:
    """The check sees a missing method, a changed keyword, a new required argument and a method for a property."""

    class Drifted(MixedPrecisionOptimizer):
        master_values = None

        def set_master_values(self, values: dict, names: list | None = None) -> None: ...

        def zero_grad(self, set_to_none: bool = True, *, group: int) -> None: ...

        def gradients_pending(self) -> bool: ...

    assert sorted(signature_problems(EngineOptimizer, Drifted)) == [
        "Drifted.gradients_pending: not a property",
        "Drifted.master_values: missing",
        "Drifted.set_master_values: 'names' is positional or keyword, the contract's is keyword-only",
        "Drifted.zero_grad: takes 'group', which the contract does not pass",
    ]


@pytest.mark.parametrize("kind", sorted(IMPLEMENTATIONS))
def test_a_built_optimizer_of_each_kind_is_an_engine_optimizer(kind: str) -> None:
    """Built by ``initialize()`` as a run builds it: every member there, data attributes included, with the answers
    of its kind (tiers, shards and a timeline only under ZeRO-Cache)."""
    seed = torch.randint(0, 10_000, ()).item()
    config = zero_cache_config("auto") if kind == "zero_cache" else ds_config(gradient_clipping=1.0)
    engine, *_ = angelptm.initialize(model=tiny_gpt(seed), config=config)
    try:
        optimizer = engine.optimizer
        assert type(optimizer) is IMPLEMENTATIONS[kind]
        assert isinstance(optimizer, EngineOptimizer)
        trained = [name for name, param in engine.module.named_parameters() if param.requires_grad]
        assert sorted(optimizer.names) == sorted(trained)
        assert optimizer.param_groups is optimizer.optimizer.param_groups
        assert not optimizer.gradients_pending and not optimizer.params_sharded and not optimizer.destroyed
        if kind == "zero_cache":
            assert isinstance(optimizer.sharding, Sharding) and optimizer.sharding.world_size == 1
            assert isinstance(optimizer.timeline, Timeline)
            used, budget = optimizer.tier_usage()["device"]
            assert 0 < used <= budget
        else:
            assert optimizer.sharding is None and optimizer.timeline is None and optimizer.tier_usage() == {}
        assert engine.zero_cache_shards == 1
    finally:
        engine.destroy()
    assert optimizer.destroyed
