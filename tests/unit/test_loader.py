"""ResumableDataLoader: its epochs and fresh iter()s are DeepSpeed's; its position survives a checkpoint, a change of
world size, and its workers' seeds."""

from __future__ import annotations

import random
from typing import Iterator

import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from angelptm.pretraining.data.loader import ResumableDataLoader


class IndexDataset(Dataset):
    """Sample i is the integer i, so a batch says exactly which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class WorkerSeedDataset(IndexDataset):
    """Sample i is (i, the seed of the worker process that loaded it)."""

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, get_worker_info().seed


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(1 << 30)
    print(f"test seed {seed}")
    return random.Random(seed)


def flat(batches) -> list[int]:
    return [int(i) for batch in batches for i in batch]


def take(batches: Iterator[torch.Tensor], k: int) -> list[torch.Tensor]:
    """The next k batches of an iterator, which goes on from there (a training loop that saves mid-epoch)."""
    return [next(batches) for _ in range(k)]


def test_state_dict_round_trip_mid_epoch(rng):
    n, b, seed = rng.randrange(40, 120), rng.randrange(2, 6), rng.randrange(1 << 20)
    first = ResumableDataLoader(IndexDataset(n), b, seed=seed)
    list(first)  # one full epoch, so the resumed position is in epoch 1
    k = rng.randrange(1, len(first))
    batches = iter(first)
    take(batches, k)
    state = first.state_dict()
    assert state == {"epoch": 1, "batches_consumed": k}
    rest = list(batches)
    resumed = ResumableDataLoader(IndexDataset(n), b, seed=seed)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(first) - k
    assert all(torch.equal(x, y) for x, y in zip(rest, again))
    assert resumed.state_dict() == first.state_dict() == {"epoch": 2, "batches_consumed": 0}


def test_epoch_advances_and_every_epoch_has_the_first_ones_order(rng):
    n, b, seed = rng.randrange(40, 120), rng.randrange(2, 6), rng.randrange(1 << 20)
    loader = ResumableDataLoader(IndexDataset(n), b, seed=seed)
    epochs = [flat(loader) for _ in range(3)]
    assert loader.epoch == 3 and loader.state_dict() == {"epoch": 3, "batches_consumed": 0}
    assert epochs[0] == epochs[1] == epochs[2] != sorted(epochs[0])
    assert flat(ResumableDataLoader(IndexDataset(n), b, seed=seed + 1)) != epochs[0]


def test_reshuffle_each_epoch_gives_each_epoch_its_own_order(rng):
    n, b, seed = rng.randrange(40, 120), rng.randrange(2, 6), rng.randrange(1 << 20)
    loader = ResumableDataLoader(IndexDataset(n), b, seed=seed, reshuffle_each_epoch=True)
    epochs = []
    for epoch in range(3):
        assert loader.epoch == epoch and loader.state_dict() == {"epoch": epoch, "batches_consumed": 0}
        samples = flat(loader)
        assert len(samples) == len(loader) * b == (n // b) * b
        assert len(set(samples)) == len(samples)  # no sample twice within an epoch
        epochs.append(samples)
    assert loader.epoch == 3
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    # The order is a function of (seed, epoch): a fresh loader set to epoch 1 replays it.
    other = ResumableDataLoader(IndexDataset(n), b, seed=seed, reshuffle_each_epoch=True)
    other.load_state_dict({"epoch": 1, "batches_consumed": 0})
    assert flat(other) == epochs[1]


def test_unshuffled_shards_are_strided_and_in_order(rng):
    world, b = rng.randrange(2, 5), rng.randrange(1, 4)
    n = world * b * rng.randrange(2, 6) + rng.randrange(world * b)  # maybe a ragged tail, which is dropped
    for rank in range(world):
        loader = ResumableDataLoader(IndexDataset(n), b, rank=rank, world_size=world, shuffle=False)
        per_rank = n // world
        expected = list(range(rank, per_rank * world, world))[: len(loader) * b]
        assert flat(loader) == expected
        assert flat(loader) == expected  # the next epoch, unshuffled, is the same


def test_too_small_datasets_are_rejected(rng):
    world = rng.randrange(2, 8)
    with pytest.raises(ValueError, match="fewer than the .* data-parallel ranks"):
        ResumableDataLoader(IndexDataset(world - 1), 1, rank=0, world_size=world)
    b = rng.randrange(2, 8)
    with pytest.raises(ValueError, match="fewer than one micro-batch"):
        ResumableDataLoader(IndexDataset(b - 1), b)
    with pytest.raises(ValueError, match="fewer than one micro-batch"):  # enough in all, too few per rank
        ResumableDataLoader(IndexDataset(world * b - 1), b, rank=0, world_size=world)


def test_seek_from_two_ranks_to_one_sees_exactly_the_unseen_samples(rng):
    b, seed = rng.randrange(1, 5), rng.randrange(1 << 20)
    per_epoch_batches = rng.randrange(3, 10)  # global batches per epoch at 2 ranks
    n = 2 * b * per_epoch_batches  # divisible by both global batches (2b and b): epoch-aligned
    ranks = [ResumableDataLoader(IndexDataset(n), b, rank=r, world_size=2, seed=seed) for r in range(2)]
    full_epochs, k = rng.randrange(0, 3), rng.randrange(1, per_epoch_batches)
    seen, rests = set(), []
    for loader in ranks:
        for _ in range(full_epochs):
            list(loader)
        rests.append(iter(loader))
        seen.update(flat(take(rests[-1], k)))
        assert loader.state_dict() == {"epoch": full_epochs, "batches_consumed": k}
    assert len(seen) == 2 * k * b
    unseen_by_the_two_ranks = set()
    for rest in rests:
        unseen_by_the_two_ranks.update(flat(rest))  # the rest of that epoch
    assert unseen_by_the_two_ranks == set(range(n)) - seen

    single = ResumableDataLoader(IndexDataset(n), b, rank=0, world_size=1, seed=seed)
    single.seek(full_epochs * n + 2 * k * b)
    assert single.state_dict() == {"epoch": full_epochs, "batches_consumed": 2 * k}
    rest = flat(single)
    assert len(rest) == len(set(rest)) == n - 2 * k * b
    assert set(rest) == set(range(n)) - seen
    assert single.epoch == full_epochs + 1


def test_seek_matches_the_per_rank_state_at_the_same_world_size(rng):
    world, b, seed = rng.randrange(1, 4), rng.randrange(1, 4), rng.randrange(1 << 20)
    n = world * b * rng.randrange(3, 8) + rng.randrange(world * b)
    loader = ResumableDataLoader(IndexDataset(n), b, rank=0, world_size=world, seed=seed)
    epoch, k = rng.randrange(0, 5), rng.randrange(0, len(loader))
    loader.seek(epoch * len(loader) * b * world + k * b * world + rng.randrange(b * world))  # partial batch: down
    assert loader.state_dict() == {"epoch": epoch, "batches_consumed": k}
    with pytest.raises(ValueError):
        loader.seek(-1)


def test_worker_seeds_are_a_function_of_seed_and_epoch(rng):
    n, b, seed = rng.randrange(8, 16), 2, rng.randrange(1 << 20)

    def worker_seeds(loader: ResumableDataLoader) -> set[int]:
        return {int(s) for _, seeds in loader for s in seeds}

    original = ResumableDataLoader(WorkerSeedDataset(n), b, seed=seed, num_workers=1)
    per_epoch = [worker_seeds(original) for _ in range(3)]
    assert all(len(s) == 1 for s in per_epoch)  # one worker, one seed per epoch
    assert len(set.union(*per_epoch)) == 3  # and a different one each epoch
    resumed = ResumableDataLoader(WorkerSeedDataset(n), b, seed=seed, num_workers=1)
    resumed.load_state_dict({"epoch": 2, "batches_consumed": 0})
    assert worker_seeds(resumed) == per_epoch[2]
    mid_epoch = ResumableDataLoader(WorkerSeedDataset(n), b, seed=seed, num_workers=1)
    mid_epoch.load_state_dict({"epoch": 1, "batches_consumed": 1})
    assert worker_seeds(mid_epoch) == per_epoch[1]
    other_seed = ResumableDataLoader(WorkerSeedDataset(n), b, seed=seed + 1, num_workers=1)
    other_seed.load_state_dict({"epoch": 1, "batches_consumed": 0})
    assert worker_seeds(other_seed) != per_epoch[1]


def deepspeeds_loader(dataset: Dataset, batch_size: int, rank: int, world_size: int) -> Iterator:
    """What ``deepspeed.initialize(training_data=dataset)`` returns on a launched rank (``local_rank`` >= 0: a
    ``DistributedSampler`` over the data-parallel ranks), with no workers and ``dataloader_drop_last``."""
    from angelptm.integrations import deepspeed_alias

    pytest.importorskip("deepspeed")
    with deepspeed_alias.suspended():  # the installed DeepSpeed, also where a test installed the alias before
        from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    return DeepSpeedDataLoader(dataset, batch_size, pin_memory=False, local_rank=0, tput_timer=None,
                               num_local_io_workers=0, data_parallel_world_size=world_size,
                               data_parallel_rank=rank, dataloader_drop_last=True)


def test_epochs_and_fresh_iters_are_deepspeeds(rng):
    """DeepSpeed's loader: every epoch in the same order, every iter() from the epoch's start (a loop that broke
    off and starts again sees the first batches again), one draw from the global generator per iter()."""
    world, b, seed = rng.choice((1, 2)), rng.randrange(2, 6), rng.randrange(1 << 20)
    n = world * (b * rng.randrange(4, 10) + rng.randrange(b))  # whole per-rank shards; a ragged last batch
    for rank in range(world):
        ours = ResumableDataLoader(IndexDataset(n), b, rank=rank, world_size=world)
        theirs = deepspeeds_loader(IndexDataset(n), b, rank, world)
        k = rng.randrange(1, len(ours))
        for loader in (ours, theirs):
            torch.manual_seed(seed)
            runs = [flat(loader), flat(loader), flat(take(iter(loader), k)), flat(loader)]
            runs.append(torch.rand(4).tolist())  # the global stream after four iter()s
            if loader is ours:
                expected = runs
        assert runs == expected
        assert expected[0] == expected[1] == expected[3] != sorted(expected[0])
        assert ours.epoch == 3, "the epoch the loop broke off in is not counted"


def test_the_resumed_iter_continues_and_leaves_the_global_stream_where_the_checkpoint_had_it(rng):
    n, b = rng.randrange(40, 120), rng.randrange(2, 6)
    k = rng.randrange(1, n // b)
    torch.manual_seed(0)
    original = ResumableDataLoader(IndexDataset(n), b)
    batches = iter(original)
    take(batches, k)
    state, generator_state = original.state_dict(), torch.get_rng_state()
    rest, after = flat(batches), torch.rand(3)
    resumed = ResumableDataLoader(IndexDataset(n), b)
    resumed.load_state_dict(state)
    torch.set_rng_state(generator_state)  # what the checkpoint's RNG state restores
    assert flat(resumed) == rest and torch.equal(torch.rand(3), after)
    assert flat(resumed) == flat(original), "after the resumed epoch, iter() starts epochs from their start again"
