"""Ending a ZeRO-Cache optimizer (DeepSpeed's ``engine.destroy()``): the module gets its weights back as
ordinary tensors, and everything else is freed now rather than whenever the objects are collected.

Why now: a script that trains twice over the same module (transformers' ``Trainer.train()`` called again, a
hyperparameter sweep's next trial) destroys the first engine and builds a second one while the first is still
referenced (by the Trainer, the accelerator). Its pinned host memory, device states and swap files would
otherwise still be held while the second engine measures its "auto" budgets, and a worker thread would be left
running per engine.

What the module gets back: replicated params are views of their device chunks and keep that storage, which is
the module's own from now on. Gathered params (sharded over ranks, or streamed from host memory or disk) are
placeholders between uses; each is bound to a whole copy of its fp32 master in the compute dtype (what the
engine's compute copy holds, and what a whole-weights read gives), on the device where this rank's shard of the
group lived there, in host memory otherwise. Sharded masters travel from the rank that owns them, one chunk at a
time (every rank calls this).
"""

from __future__ import annotations

from typing import Any

import torch

from zero_cache.shard_params import gather_objects
from zero_cache.tier_names import DEVICE


def release(optimizer: Any) -> None:
    """Finish ``optimizer``'s pending work, hand its module the weights, remove its hooks and free its storage,
    buffers, swap files and worker thread (a :class:`~zero_cache.optimizer.ZeroCacheOptimizer`; it cannot step
    again). A collective over the data-parallel ranks when params are sharded."""
    optimizer.finish_pending()
    store = optimizer.store
    if optimizer.exchange is not None:
        optimizer.exchange.close()
    if store.shard_params:
        hand_back_gathered_params(optimizer)
    for handle in optimizer.hooks:
        handle.remove()
    optimizer.hooks.clear()
    optimizer.host.close()
    optimizer.device_steps.close()
    store.close()


def hand_back_gathered_params(optimizer: Any) -> None:
    """Bind each gathered parameter to a whole copy of its current weights (see the module docstring)."""
    store, gather = optimizer.store, gather_objects(optimizer.store.sharding)
    param_of = {slot.name: param for slot, param in zip(store.slots, store.params)}
    with torch.no_grad():
        for chunk in range(store.layout.num_chunks):
            slots = store.slots_of(chunk)
            owned = optimizer.master_values([slot.name for slot in slots]) if store.sharding.owns(chunk) else {}
            masters = {name: value for part in gather(owned) for name, value in part.items()}
            device = store.tiers[DEVICE].device if store.home_of(chunk) == DEVICE else torch.device("cpu")
            for slot in slots:
                param_of[slot.name].data = masters[slot.name].to(device=device, dtype=store.compute_dtype)
