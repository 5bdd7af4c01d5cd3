"""A new kind of optimizer-state home is one class and one registry entry (DESIGN.md: "A new home is one new class").

The toy home below keeps each group's states in a plain dict of ordinary (unpinned, unbudgeted) CPU tensors and is
registered for the host tier in place of :class:`~zero_cache.storage.state_homes.home.HostStates`: every group the plan
puts on the host lives there, and the host's Adam reaches it only through the home (fetch, write back, open). The
exactness tests of the host's update paths and of resuming are imported below and run again with it; they must hold bit
for bit, as with the pinned host home.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import pytest
import torch
from reference import random_batches, train_steps
from test_zero_cache_engine import test_resume_with_zero_cache_is_exact  # noqa: F401  (run again here)
from test_zero_cache_update_paths import (  # noqa: F401  (the tests: run again here)
    build,
    host_chunks,
    test_a_non_finite_gradient_skips_the_step_and_keeps_every_weight,
    test_update_in_backward_is_the_same_arithmetic_as_after_backward,
    test_zero_grad_after_backward_restores_the_params_the_gradients_overwrote,
)

from zero_cache.plan.state_costs import STATE_COSTS
from zero_cache.plan.tier_names import HOST
from zero_cache.storage.state_homes import registry as state_homes
from zero_cache.storage.state_homes.home import STATE_FIELDS, FetchedStates, HostStates, OptimizerGroup, StateHome


class DictStates(StateHome):
    """Toy: a host-Adam home whose states live in a dict (group id -> fp32 tensor), outside any tier or pool. They are
    not in ``OptimizerGroup.states``, so no lazy update folds into them later and the device never steps them."""

    costs = dataclasses.replace(STATE_COSTS[HOST], resident=False, device_steppable=False)
    used: dict[str, int] = {}
    """What the runs asked of the toy homes (to check the tests ran through one)."""

    def __init__(self, tiers: dict[str, Any], numel: int, accumulate: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(tiers, numel, accumulate, dtype)
        self.values: dict[int, torch.Tensor] = {}

    def _count(self, what: str) -> None:
        DictStates.used[what] = DictStates.used.get(what, 0) + 1

    def allocate(self) -> OptimizerGroup:
        group = OptimizerGroup(home=self, states=None, grad=self._allocate_grad())
        self.values[id(group)] = torch.zeros(len(STATE_FIELDS) * self.numel, dtype=self.dtype)
        self._count("allocate")
        return group

    def free(self, group: OptimizerGroup) -> None:
        del self.values[id(group)]
        if group.grad is not None:
            self.tiers[self.grad_tier].free(group.grad)

    def held_bytes(self) -> dict[str, int]:
        return self._with_grad_bytes({})

    @contextlib.contextmanager
    def open(self, group: OptimizerGroup, *, write_back: bool = False, fresh: bool = False
             ) -> Iterator[torch.Tensor]:
        yield self.values[id(group)]

    def fetch(self, group: OptimizerGroup) -> FetchedStates:
        self._count("fetch")
        return FetchedStates(home=self, states=self.values[id(group)])


@pytest.fixture(autouse=True)
def toy_host_home(monkeypatch):
    """Every group the plan puts on the host goes to a :class:`DictStates`; the test must have updated some there."""
    monkeypatch.setitem(state_homes.STATE_HOME_CLASSES, HOST, DictStates)
    DictStates.used.clear()
    yield
    assert DictStates.used.get("allocate", 0) > 0 and DictStates.used.get("fetch", 0) > 0, DictStates.used


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_the_toy_home_trains_bit_for_bit_like_the_pinned_host_home(monkeypatch, update_in_backward):
    """The same run with the toy home and with the registry's own host home: the same losses and masters, exactly
    (during backward the toy's updates are never lazy, which changes no value)."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=8)
    runs = []
    for home in (DictStates, HostStates):
        monkeypatch.setitem(state_homes.STATE_HOME_CLASSES, HOST, home)
        engine, optimizer = build(seed, clip=0.0, update_in_backward=update_in_backward)
        assert host_chunks(optimizer) and all(isinstance(optimizer.store.state_home(c), home)
                                              for c in host_chunks(optimizer))
        runs.append((train_steps(engine, batches), optimizer.master_state_dict()))
    (toy_losses, toy_masters), (host_losses, host_masters) = runs
    assert toy_losses == host_losses
    for name, value in host_masters.items():
        assert torch.equal(toy_masters[name], value), name
