"""HostAdam's beta powers on DeepSpeed's cpu_adam (:meth:`HostAdam._powers_as_in_sequence`): a resumed run replays
the earlier steps once, and nothing is replayed where the betas change (param groups with betas of their own, a
schedule cycling momentum), which once replayed the whole run at every such call: quadratic in the run's length."""

from __future__ import annotations

import random

import torch

from zero_cache.optim.host_adam import HostAdam


class CountingOp:
    """cpu_adam's ``adam_update`` as calls counted, the real update left out (only the call pattern is asked)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []  # (step, lr) of every call

    def adam_update(self, opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, *tensors) -> None:
        self.calls.append((step, lr))


def adam_on(op: CountingOp) -> HostAdam:
    adam = HostAdam(decoupled=True, try_deepspeed=False)
    adam._ds = (op, 0)
    return adam


def one_step(adam: HostAdam, step: int, betas: tuple[float, float]) -> None:
    tensors = [[torch.zeros(3)] for _ in range(4)]
    adam.update(*tensors, step=step, lr=1e-3, betas=betas, eps=1e-8, weight_decay=0.0)


def test_groups_with_their_own_betas_replay_nothing_however_long_the_run():
    op, rng = CountingOp(), random.Random(3)
    adam = adam_on(op)
    steps = rng.randint(30, 60)
    for step in range(1, steps + 1):
        one_step(adam, step, (0.9, 0.999))
        one_step(adam, step, (rng.uniform(0.8, 0.89), 0.95))  # a second group, or a schedule's momentum
    assert len(op.calls) == 2 * steps, "a change of betas is the op's (pow) as in DeepSpeed's own run"


def test_a_resumed_run_replays_its_earlier_steps_once_with_lr_zero():
    op, rng = CountingOp(), random.Random(5)
    adam = adam_on(op)
    resumed_at = rng.randint(20, 80)
    for step in range(resumed_at, resumed_at + 5):
        one_step(adam, step, (0.9, 0.999))
    replays = [call for call in op.calls if call[1] == 0.0]
    assert [s for s, _ in replays] == [1, *range(1, resumed_at)]  # the reset call, then steps 1 .. resumed_at - 1
    assert len(op.calls) - len(replays) == 5
    one_step(adam, 3, (0.9, 0.999))  # an earlier checkpoint loaded: replayed again, once
    assert sum(1 for _, lr in op.calls if lr == 0.0) == len(replays) + 3
