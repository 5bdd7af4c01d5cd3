"""Sharded params on CPU, one rank: the acquisition trace (pure), and GatheredGroups over a real ChunkStore.

With ``Sharding()`` every group is one chunk; its shard is at home on the host (``param_home`` "host"), so
each acquisition copies it into a fresh group buffer, and gathering, eviction, placeholders and autograd's
re-gathering in backward all run here as they do on a GPU (without the asynchronous copies).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from zero_cache.base.sharding import Sharding
from zero_cache.plan.layout import pack
from zero_cache.plan.planner import DEVICE, HOST, PlanInputs, make_plan
from zero_cache.runtime.gathered import RECENT, AcquisitionTrace, GatheredGroups
from zero_cache.runtime.transfers import Transfers
from zero_cache.storage.chunks import ChunkStore
from zero_cache.storage.tiers import build_tiers

FEATURES = 16
BUDGET_BYTES = 2**24
FP32_BYTES = 4


def derived_seed(salt: int) -> int:
    """A fresh seed per run, printed so pytest shows it with a failure."""
    seed = salt * 7919 + random.randrange(10**6)
    print(f"seed {seed}")
    return seed


# ------------------------------------------------------------------ AcquisitionTrace (pure)

def collapse(sequence: list[int]) -> list[int]:
    """Consecutive repeats dropped."""
    return [g for i, g in enumerate(sequence) if i == 0 or sequence[i - 1] != g]


def reference_upcoming(trace: list[int], cursor: int, count: int) -> list[int]:
    """The first ``count`` distinct groups after ``cursor``, without the group at the cursor (none before the
    iteration's first known group: there is no position to look ahead from)."""
    if cursor < 0:
        return []
    out: list[int] = []
    for group in trace[cursor + 1:]:
        if group != trace[cursor] and group not in out:
            out.append(group)
    return out[:count]


def reference_next_use(trace: list[int], cursor: int, group: int) -> int:
    later = [p - cursor for p in range(cursor + 1, len(trace)) if trace[p] == group]
    return later[0] if later else len(trace) + 1


def reference_cursor(trace: list[int], cursor: int, group: int) -> int:
    """Where the cursor goes when ``group`` is acquired: it stays on ``group``, else its next place in the
    trace (wrapping to its first), else nowhere new."""
    if 0 <= cursor and trace[cursor] == group:
        return cursor
    places = [p for p, g in enumerate(trace) if g == group]
    after = [p for p in places if p > cursor]
    return after[0] if after else places[0] if places else cursor


def random_acquisitions(rng: random.Random, num_groups: int, length: int) -> list[int]:
    """Random groups with frequent immediate repeats (a module's second saved tensor, a two-group module)."""
    sequence = [rng.randrange(num_groups)]
    while len(sequence) < length:
        sequence.append(sequence[-1] if rng.random() < 0.3 else rng.randrange(num_groups))
    return sequence


def check_cursor(trace: AcquisitionTrace, cursor: int, num_groups: int) -> None:
    recorded = trace.groups
    for count in (1, 2, 3, num_groups + 1):
        assert trace.upcoming(count) == reference_upcoming(recorded, cursor, count), (cursor, count)
    for group in range(num_groups + 1):  # + one group that is never acquired
        assert trace.next_use(group) == reference_next_use(recorded, cursor, group), (cursor, group)


@pytest.mark.parametrize("salt", range(10))
def test_trace_records_collapsed_then_replays_with_brute_force_upcoming_and_next_use(salt):
    rng = random.Random(derived_seed(salt))
    num_groups = rng.randint(2, 7)
    sequence = [0]
    while len(collapse(sequence)) < 3:  # something to look ahead in
        sequence = random_acquisitions(rng, num_groups, rng.randint(5, 40))
    trace = AcquisitionTrace()
    for group in sequence:
        trace.visit(group)
        assert trace.recording and trace.upcoming(num_groups) == []
    recorded = collapse(sequence)
    assert trace.groups == recorded

    trace.new_iteration()
    assert not trace.recording and trace.upcoming(num_groups) == []  # nothing acquired yet this iteration
    cursor = -1
    for group in sequence:
        trace.visit(group)
        cursor = reference_cursor(recorded, cursor, group)
        check_cursor(trace, cursor, num_groups)
    assert cursor == len(recorded) - 1  # replaying the recorded order walks the whole trace
    assert trace.groups == recorded  # replay does not record

    # A later iteration that deviates (skips, jumps back, a group never recorded): the cursor follows the
    # next place of each group and stays put for an unknown one.
    trace.new_iteration()
    cursor = -1
    for group in random_acquisitions(rng, num_groups + 1, 30):
        before = (trace.upcoming(num_groups), [trace.next_use(g) for g in range(num_groups + 1)])
        trace.visit(group)
        cursor = reference_cursor(recorded, cursor, group)
        check_cursor(trace, cursor, num_groups)
        if group not in recorded:
            assert (trace.upcoming(num_groups), [trace.next_use(g) for g in range(num_groups + 1)]) == before


def test_trace_keeps_recording_until_an_iteration_has_acquired_something():
    trace = AcquisitionTrace()
    trace.new_iteration()  # an empty first iteration ends nothing
    trace.visit(3)
    trace.visit(1)
    assert trace.recording and trace.upcoming(2) == []
    trace.new_iteration()
    trace.visit(3)
    assert not trace.recording and trace.upcoming(2) == [1]
    trace.visit(1)
    assert trace.upcoming(2) == [] and trace.next_use(3) == 3  # not used again: len(trace) + 1


# ------------------------------------------------------------------ GatheredGroups over a real ChunkStore

class Sharded:
    """A plain Linear stack whose params live in a sharded ChunkStore (one rank, fp32), and a twin reference."""

    def __init__(self, seed: int, *, num_layers: int, chunk_numel: int, max_live: int = 3, ahead: int = 1) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(*[nn.Linear(FEATURES, FEATURES) for _ in range(num_layers)])
        self.reference = copy.deepcopy(self.model)
        self.original = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        named = list(self.model.named_parameters())
        layout = pack([(name, tuple(p.shape)) for name, p in named], chunk_numel)
        self.params = [p for _, p in named]
        self.names = [name for name, _ in named]
        plan = make_plan(PlanInputs(num_chunks=layout.num_chunks, chunk_numel=layout.chunk_numel,
                                    param_bytes_per_element=FP32_BYTES, device_budget_bytes=BUDGET_BYTES,
                                    host_budget_bytes=BUDGET_BYTES, grad_bytes_per_element=0,
                                    param_chunks_held=layout.num_chunks, param_home="host",
                                    gradient_buckets=max_live))
        device, host = build_tiers(torch.device("cpu"), BUDGET_BYTES, BUDGET_BYTES)
        self.store = ChunkStore(layout, self.params, plan, {DEVICE: device, HOST: host}, torch.float32,
                                accumulate=False, sharding=Sharding(), shard_params=True)
        self.num_groups = self.store.sharding.num_groups(layout.num_chunks)
        self.gathered = GatheredGroups(self.store, max_live=max_live, ahead=ahead, wait_owned=lambda group: None,
                                       transfers=Transfers(torch.device("cpu")))
        self.group_of_param = [self.store.sharding.group_of(slot.chunk) for slot in self.store.slots]
        self.after_hook: list = []  # called after each module's groups are acquired

    def install_hooks(self) -> None:
        """What attach.py's forward pre-hooks do through prepare_chunk: acquire the module's groups in order."""
        group_of = {id(p): g for p, g in zip(self.params, self.group_of_param)}
        for module in self.model:
            groups = sorted({group_of[id(p)] for p in module.parameters()})

            def before_forward(_module, _inputs, groups=groups) -> None:
                for group in groups:
                    self.gathered.acquire(group)
                for check in self.after_hook:
                    check(groups)

            module.register_forward_pre_hook(before_forward)

    def check_params(self) -> None:
        """Live groups hold the original weights; the others are one-element placeholders of the right shape."""
        live = set(self.gathered.live_groups)
        for name, param, group in zip(self.names, self.params, self.group_of_param):
            assert param.shape == self.original[name].shape, name
            if group in live:
                assert torch.equal(param.detach(), self.original[name]), name
            else:
                assert param.untyped_storage().nbytes() == FP32_BYTES, name

    def iteration(self, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward (saving params by position) and backward; returns (output, the input, whose ``.grad``
        backward filled)."""
        self.gathered.new_iteration()
        inputs = torch.randn(4, FEATURES, generator=rng, requires_grad=True)
        with self.gathered.saving():
            output = self.model(inputs)
        loss = (output * torch.linspace(-1.0, 2.0, FEATURES)).square().sum()
        self.gathered.release_all()  # nothing is live when backward starts: every weight is gathered again
        loss.backward()
        return output.detach(), inputs


def lru_reference(sequence: list[int], max_live: int) -> tuple[list[list[int]], int]:
    """The warm-up policy: live groups in order of last use, evict the least recent one that is not among the
    last RECENT acquired. Returns the live groups after each acquisition, and the gathers."""
    live: list[int] = []
    recent: list[int] = []
    states, gathers = [], 0
    for group in sequence:
        recent = [group, *(g for g in recent if g != group)][:RECENT]
        if group in live:
            live.remove(group)
        else:
            while len(live) >= max_live:
                live.remove(next(g for g in live if g not in recent))
            gathers += 1
        live.append(group)
        states.append(list(live))
    return states, gathers


@pytest.mark.parametrize("chunk_numel", [320, 256])  # a Linear per chunk, or its weight and bias in two
def test_acquire_gathers_the_original_weights_and_keeps_at_most_max_live(chunk_numel):
    seed = derived_seed(chunk_numel)
    rng = random.Random(seed)
    sharded = Sharded(seed, num_layers=rng.randint(5, 6), chunk_numel=chunk_numel)
    gathered, max_live = sharded.gathered, sharded.gathered.max_live
    assert sharded.num_groups >= 5 and max_live == 3
    sharded.check_params()  # nothing gathered yet: every param is a placeholder
    assert gathered.live_groups == []

    sequence = random_acquisitions(rng, sharded.num_groups, 60)
    expected_live, expected_gathers = lru_reference(sequence, max_live)
    for group, expected in zip(sequence, expected_live):
        buffer = gathered.acquire(group)
        assert buffer.numel() == sharded.store.layout.chunk_numel  # one rank: the group is one chunk
        assert group in gathered.live_groups and len(gathered.live_groups) <= max_live
        assert gathered.live_groups == expected  # while recording: least recently used goes first
        sharded.check_params()
    assert gathered.gathers == expected_gathers
    assert len(set(sequence)) > max_live  # so eviction was exercised

    gathered.release_all()
    assert gathered.live_groups == []
    sharded.check_params()
    assert all(p.untyped_storage().nbytes() == FP32_BYTES for p in sharded.params)


def test_replayed_acquisitions_evict_the_furthest_next_use():
    """After the recording, a victim is never needed sooner than a group kept in its place (Belady)."""
    seed = derived_seed(1)
    rng = random.Random(seed)
    sharded = Sharded(seed, num_layers=5, chunk_numel=256, max_live=4)
    gathered = sharded.gathered
    sequence = random_acquisitions(rng, sharded.num_groups, 50)
    for group in sequence:
        gathered.acquire(group)
    gathered.release_all()
    gathered.new_iteration()
    evictions, recent = 0, []
    for group in sequence:
        before = set(gathered.live_groups)
        gathered.acquire(group)
        recent = [group, *(g for g in recent if g != group)][:RECENT]  # never evicted
        after = set(gathered.live_groups)
        assert len(after) <= gathered.max_live
        assert set(gathered.trace.upcoming(gathered.ahead)) <= after  # gathered ahead of use
        victims = before - after
        kept = (before & after) - set(recent)
        if victims and kept:
            evictions += 1
            next_use = gathered.trace.next_use
            assert min(map(next_use, victims)) >= max(map(next_use, kept)), (group, victims, kept)
        sharded.check_params()
    assert evictions > 0


@pytest.mark.parametrize("chunk_numel", [320, 256])
def test_backward_regathers_saved_weights_and_matches_plain_autograd(chunk_numel):
    seed = derived_seed(chunk_numel)
    sharded = Sharded(seed, num_layers=5, chunk_numel=chunk_numel)
    sharded.install_hooks()
    sharded.after_hook.append(lambda groups: sharded.check_params())
    generator = torch.Generator().manual_seed(seed)
    output, inputs = sharded.iteration(generator)
    assert sharded.gathered.gathers > sharded.num_groups  # backward gathered weights again

    reference_inputs = inputs.detach().clone().requires_grad_(True)
    reference_output = sharded.reference(reference_inputs)
    (reference_output * torch.linspace(-1.0, 2.0, FEATURES)).square().sum().backward()
    torch.testing.assert_close(output, reference_output.detach())
    torch.testing.assert_close(inputs.grad, reference_inputs.grad)
    # The params were placeholders when their gradients arrived; AccumulateGrad still gives each a .grad of
    # the param's shape (the optimizer's hooks, not installed here, would reduce it into the shard instead).
    for name, param, reference in zip(sharded.names, sharded.params, sharded.reference.parameters()):
        assert param.grad is not None and param.grad.shape == reference.shape, name
        torch.testing.assert_close(param.grad, reference.grad, msg=name)
    assert reference_inputs.grad.abs().sum() > 0


def test_a_closed_group_is_not_gathered_until_release_all():
    seed = derived_seed(2)
    sharded = Sharded(seed, num_layers=5, chunk_numel=320)
    gathered = sharded.gathered
    for group in range(sharded.num_groups):  # record 0, 1, ..., n-1
        gathered.acquire(group)
    gathered.release_all()
    gathered.new_iteration()

    gathered.acquire(0)
    assert 1 in gathered.live_groups  # gathered ahead along the trace
    gathered.release(1, closed=True)
    assert 1 not in gathered.live_groups
    assert sharded.params[sharded.group_of_param.index(1)].untyped_storage().nbytes() == FP32_BYTES
    with pytest.raises(RuntimeError, match="chunk group 1 is used again"):
        gathered.acquire(1)
    gathered.release_all()
    gathered.new_iteration()
    gathered.acquire(1)
    assert 1 in gathered.live_groups
    sharded.check_params()

    assert 3 not in gathered.live_groups
    gathered.release(3, closed=True)  # not live: closing it still keeps the gather ahead out of it
    gathered.acquire(2)
    assert gathered.trace.upcoming(1) == [3] and 3 not in gathered.live_groups
    with pytest.raises(RuntimeError):
        gathered.acquire(3)


@pytest.mark.parametrize("chunk_numel", [320, 256])
def test_the_second_iteration_gathers_ahead_along_the_recorded_trace(chunk_numel):
    seed = derived_seed(chunk_numel)
    sharded = Sharded(seed, num_layers=5, chunk_numel=chunk_numel)
    sharded.install_hooks()
    generator = torch.Generator().manual_seed(seed)
    first_output, _ = sharded.iteration(generator)
    gathered = sharded.gathered
    gathered.release_all()
    recorded = list(gathered.trace.groups)
    forward = list(range(sharded.num_groups))
    assert recorded[:len(forward)] == forward and len(recorded) > len(forward)  # forward, then backward

    ahead_seen = []

    def next_in_trace_is_live(groups: list[int]) -> None:
        position = max(recorded.index(g) for g in groups)
        following = [g for g in recorded[position + 1:] if g != recorded[position]][:gathered.ahead]
        assert set(following) <= set(gathered.live_groups), (groups, following, gathered.live_groups)
        ahead_seen.extend(following)
        sharded.check_params()

    sharded.after_hook.append(next_in_trace_is_live)
    output, _ = sharded.iteration(torch.Generator().manual_seed(seed))
    assert not gathered.trace.recording and gathered.trace.groups == recorded  # followed, not re-recorded
    first_module = len({sharded.group_of_param[0], sharded.group_of_param[1]})  # its weight and bias groups
    assert ahead_seen[0] == recorded[first_module]  # after the first module's groups, the next one was live
    torch.testing.assert_close(output, first_output)  # same input, same weights


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_blocks_recompute_with_gathered_weights(use_reentrant):
    """A two-layer block spans four groups, more than max_live: the recomputation in backward evicts groups whose
    views autograd still holds, and those views must stay valid until backward is done with them."""
    seed = derived_seed(4 + use_reentrant)
    sharded = Sharded(seed, num_layers=6, chunk_numel=256)
    sharded.install_hooks()
    blocks = [sharded.model[i:i + 2] for i in range(0, 6, 2)]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):  # recording, then following the trace
        sharded.gathered.new_iteration()
        inputs = torch.randn(4, FEATURES, generator=generator, requires_grad=True)
        with sharded.gathered.saving():
            hidden = inputs
            for block in blocks:
                hidden = torch.utils.checkpoint.checkpoint(block, hidden, use_reentrant=use_reentrant)
        sharded.gathered.release_all()
        hidden.square().sum().backward()
        assert len(sharded.gathered.live_groups) <= sharded.gathered.max_live
        sharded.gathered.release_all()

        reference_inputs = inputs.detach().clone().requires_grad_(True)
        sharded.reference(reference_inputs).square().sum().backward()
        torch.testing.assert_close(inputs.grad, reference_inputs.grad)
        for name, param, reference in zip(sharded.names, sharded.params, sharded.reference.parameters()):
            torch.testing.assert_close(param.grad, reference.grad, msg=name)
            param.grad, reference.grad = None, None
    forward = list(range(sharded.num_groups))
    assert sharded.gathered.trace.groups[:len(forward)] == forward
    assert len(sharded.gathered.trace.groups) >= 2 * len(forward)  # every group again in the recomputation


def test_an_activation_modified_in_place_after_saving_still_raises():
    """Saved-tensor hooks switch off autograd's version check; saving() keeps it for everything it does not pack."""
    gathered = GatheredGroups.__new__(GatheredGroups)
    gathered._group_at = {}
    x = torch.randn(3, requires_grad=True)
    with gathered.saving():
        y = x.exp()  # saves its output
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        y.sum().backward()
