"""Ending a ZeRO-Cache optimizer (DeepSpeed's ``engine.destroy()``): the module gets its weights back as
ordinary tensors, and everything else is freed now rather than whenever the objects are collected.

Why now: a script that trains twice over the same module (transformers' ``Trainer.train()`` called again, a
hyperparameter sweep's next trial) destroys the first engine and builds a second one while the first is still
referenced (by the Trainer, the accelerator). Its pinned host memory, device states and swap files would
otherwise still be held while the second engine measures its "auto" budgets, and a worker thread would be left
running per engine.

What the module gets back, with the work of the last step landed first (and a window between ``backward()`` and
``step()`` dropped, its updates during backward taken back, as ``zero_grad()`` does):

* replicated params are views of their device chunks and keep that storage, which is the module's own from now
  on; where the optimizer states are sharded over ranks, the chunks other ranks own are brought up to date first
  (they held this rank's gradients since the step);
* gathered params (sharded over ranks, or streamed from host memory or disk) are placeholders between uses; each
  is bound to a whole copy of its fp32 master in the compute dtype (what the engine's compute copy holds), in host
  memory: the whole model may not fit the device, which is why it was gathered. The masters travel from the rank
  that owns them, one chunk at a time.

Every rank calls it when the states are sharded (it syncs and gathers). Should settling the last step fail (the
worker's error, e.g. a full disk), the worker thread is stopped and the error raised, and nothing is freed: the
storage still holds what the failed step left.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_cache.runtime.shard_params import gather_objects


def release(optimizer: Any) -> None:
    """Settle ``optimizer`` (a :class:`~zero_cache.optim.optimizer.ZeroCacheOptimizer`), hand its module the weights,
    remove its hooks and free its storage, buffers, swap files and worker thread; it cannot step again."""
    try:
        if optimizer.gradients_pending:  # between backward() and step(): gradients sit where the weights go
            optimizer.zero_grad()
        optimizer.finish_pending()
        optimizer.sync_params()
    except BaseException:
        optimizer.host.close()
        raise
    if optimizer.exchange is not None:
        optimizer.exchange.close()  # (gathered groups and buckets first: their device memory is not needed)
    if optimizer.store.shard_params:
        hand_back_gathered_params(optimizer)  # (reading the masters waits for the worker: it still runs)
    optimizer.host.close()
    optimizer.device_steps.close()
    for handle in optimizer.hooks:
        handle.remove()
    optimizer.hooks.clear()
    optimizer.store.close()


def hand_back_gathered_params(optimizer: Any) -> None:
    """Bind each gathered parameter to a whole copy of its current weights in host memory (see the module
    docstring)."""
    store, gather = optimizer.store, gather_objects(optimizer.store.sharding)
    param_of = {slot.name: param for slot, param in zip(store.slots, store.params)}
    with torch.no_grad():
        for chunk in range(store.layout.num_chunks):
            slots = store.slots_of(chunk)
            owned = optimizer.master_values([slot.name for slot in slots]) if store.sharding.owns(chunk) else {}
            masters = {name: value for part in gather(owned) for name, value in part.items()}
            for slot in slots:
                param_of[slot.name].data = masters[slot.name].to(store.compute_dtype)
