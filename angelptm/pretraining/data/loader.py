"""A data loader whose position is part of the checkpoint, so a resumed run sees the same batches.

Its epochs are those of DeepSpeed's ``DeepSpeedDataLoader`` (``deepspeed/runtime/dataloader.py``), which builds
a ``DistributedSampler`` and never calls its ``set_epoch``:

* every epoch visits the same order: one seeded permutation (or identity), cut into one strided slice per
  data-parallel rank like ``DistributedSampler`` with ``drop_last`` (``reshuffle_each_epoch`` draws a new
  permutation per epoch instead, from seed + epoch);
* every ``iter()`` starts the epoch over, as DeepSpeed's ``__iter__`` builds a new ``DataLoader`` iterator,
  and draws one number from the global torch generator as that iterator does (for its workers' base seed),
  so a script's random stream (dropout, augmentation in the main process) matches DeepSpeed's run.

The one exception is a restored position (``load_state_dict`` / ``seek``): the next ``iter()`` starts there.
The loader counts the batches it has *handed out* (not those its workers prefetched), which is exactly the
position to restart from. A restored position inside an epoch makes no draw from the global generator: the
original run drew it when its iterator started, before the checkpoint captured the generator's state.

The DataLoader's own generator (which draws each iterator's worker base seed) is reseeded from
(seed, epoch) at every ``iter``, so the seeds of an epoch's workers are also a pure function of
(seed, epoch) and a resumed run gives its workers the same seeds as the original run did.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from angelptm.errors import DataError


class ResumableSampler(Sampler[int]):
    """Seeded per-epoch order over a dataset, sharded over ranks, that can start mid-epoch.

    Args:
        num_samples: dataset length.
        rank: this rank.
        world_size: data-parallel ranks.
        shuffle: visit a seeded permutation, else the samples in order.
        seed: base seed of the permutation.
        reshuffle_each_epoch: a new permutation each epoch (seed + epoch); False keeps the first one (seed + 0)
            for every epoch, as DeepSpeed's ``DistributedSampler`` without ``set_epoch`` does.
    """

    def __init__(self, num_samples: int, *, rank: int = 0, world_size: int = 1, shuffle: bool = True,
                 seed: int = 0, reshuffle_each_epoch: bool = False) -> None:
        if num_samples < world_size:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than the {world_size} data-parallel ranks")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.shuffle, self.seed, self.reshuffle_each_epoch = shuffle, seed, reshuffle_each_epoch
        self.epoch = 0
        self.start = 0  # samples of this rank's shard to skip at the next __iter__

    def __len__(self) -> int:
        return self.num_samples // self.world_size

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + (self.epoch if self.reshuffle_each_epoch else 0))
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        shard = order[: len(self) * self.world_size][self.rank::self.world_size]
        start, self.start = self.start, 0
        return iter(shard[start:].tolist())


class ResumableDataLoader:
    """Iterates epochs of micro-batches as DeepSpeed's loader does, and remembers where it stopped.

    ``iter(loader)`` starts the current epoch over (see the module's docstring); once an epoch is exhausted the next
    ``iter`` starts the following one. ``state_dict`` / ``load_state_dict`` carry (epoch, batches consumed) through
    a checkpoint, and the first ``iter`` after ``load_state_dict`` (or :meth:`seek`) continues from there.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per micro-batch on this rank.
        rank, world_size, shuffle, seed, reshuffle_each_epoch: see :class:`ResumableSampler`.
        num_workers: DataLoader worker processes.
        collate_fn: optional batch collation.
        batch_key: the setting ``batch_size`` comes from, named when the data holds less than one batch.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0, collate_fn: Any = None,
                 pin_memory: bool = False, batch_key: str = "train_micro_batch_size_per_gpu",
                 reshuffle_each_epoch: bool = False) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = ResumableSampler(len(dataset), rank=rank, world_size=world_size, shuffle=shuffle, seed=seed,
                                        reshuffle_each_epoch=reshuffle_each_epoch)
        if len(self.sampler) < batch_size:
            raise DataError(
                f"{batch_key} {batch_size}: each rank gets {len(self.sampler)} samples per epoch "
                f"({len(dataset)} samples over {world_size} ranks), fewer than one micro-batch of {batch_size}; "
                f"use at most {len(self.sampler)}, or more data")
        # A private generator: every DataLoader iterator draws a base seed from it, and drawing from the
        # global RNG instead would shift the dropout stream of a resumed run by one draw. It is reseeded
        # from (seed, epoch) by every __iter__, so the worker seeds do not depend on how many iterators
        # this process created before (a resumed run would otherwise replay epoch 0's seeds).
        self.seed = seed
        self.generator = torch.Generator()
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, num_workers=num_workers,
                                 collate_fn=collate_fn, drop_last=True, pin_memory=pin_memory,
                                 persistent_workers=False, generator=self.generator)
        self.batches_consumed = 0
        self._restored: int | None = None  # a position from load_state_dict / seek, for the next __iter__ only

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank."""
        return len(self.sampler) // self.batch_size

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def _epoch_seed(self) -> int:
        """The seed of this epoch's worker base seed: a pure function of (seed, epoch), in torch's seed range."""
        return (self.seed * 1_000_003 + self.sampler.epoch) % (1 << 64)

    def __iter__(self) -> Iterator[Any]:
        """The current epoch's micro-batches from its start, or from a restored position.

        Like DeepSpeed's ``__iter__`` the work happens here, not at the first ``next``: the epoch's position
        resets now and the draw from the global generator happens now.
        """
        start, self._restored = self._restored or 0, None
        if start == 0:
            # A DataLoader without a generator (DeepSpeed's) draws its workers' base seed from the global generator
            # when its iterator starts: the same draw, so the random numbers the script takes next match.
            torch.empty((), dtype=torch.int64).random_()
        self.batches_consumed = start
        self.generator.manual_seed(self._epoch_seed())
        self.sampler.start = start * self.batch_size
        return self._batches(iter(self.loader))

    def _batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self.batches_consumed += 1
            yield batch
        # Only a fully consumed epoch advances; a loop that breaks early leaves the epoch where it was.
        self.sampler.epoch += 1
        self.batches_consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position; the next ``iter`` starts there."""
        self.sampler.epoch = state["epoch"]
        self.batches_consumed = self._restored = state["batches_consumed"]

    def seek(self, global_samples: int) -> None:
        """Position the loader after ``global_samples`` samples consumed by all ranks together.

        For resuming a checkpoint saved at another world size, where the per-rank positions do not
        apply. One global batch is ``batch_size * world_size`` samples (this loader's values) and an
        epoch is ``len(self)`` global batches; the position becomes
        ``epoch = global_samples // samples_per_epoch`` and
        ``batches_consumed = (global_samples % samples_per_epoch) // (batch_size * world_size)``
        (a partial global batch is rounded down: those samples are seen again).

        The order within an epoch is one permutation of the dataset that depends on (seed, epoch)
        only (on seed alone unless ``reshuffle_each_epoch``), and the ranks take strided slices of its first
        ``samples_per_epoch`` entries; the first ``n`` global batches therefore cover its first
        ``n * batch_size * world_size`` entries whatever the world size. So when the epoch length in global
        samples is unchanged (the dataset's length divides into both the old and the new global batch), the samples the
        resumed run still sees in this epoch are exactly those the original run had not yet seen;
        otherwise the epoch boundaries move and the match is approximate.
        """
        if global_samples < 0:
            raise ValueError(f"global_samples must be >= 0, got {global_samples}")
        global_batch = self.batch_size * self.sampler.world_size
        samples_per_epoch = len(self) * global_batch
        self.sampler.epoch = global_samples // samples_per_epoch
        self.batches_consumed = self._restored = (global_samples % samples_per_epoch) // global_batch


def repeat_batches(loader: ResumableDataLoader) -> Iterator[Any]:
    """Endless micro-batches, epoch after epoch (the epoch counter advances as it goes)."""
    while True:
        yield from loader
