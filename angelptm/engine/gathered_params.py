"""``deepspeed.zero.GatheredParameters`` on this engine: whole weights to read or edit, edits reaching the engine.

Before ``initialize()`` a model's parameters are whole tensors (``zero.Init`` builds them whole, in the
compute dtype), so the context has nothing to gather; with ``modifier_rank`` and several ranks it
broadcasts the modifier's values on exit, as DeepSpeed's re-partitioning makes every rank hold them.

After ``initialize()`` the engine owns the weights: the module's parameters are views into ZeRO-Cache's
chunks, or placeholders while their chunk group is sharded or streamed, and the fp32 master of each
lives in the optimizer (chunk states on the device, the host or disk, or the replicated optimizer's
masters). On entry each parameter is rebound to a whole, current copy read from its master (in the
compute dtype). On exit with ``modifier_rank`` the modifier's values are broadcast, and the elements
that changed are written into the masters, from which the engine rewrites its compute copies (chunk
storage included); elements left alone keep their full-precision masters, so editing one row of a
bf16 embedding does not round the rest. Then each parameter is bound back to the engine's storage.
``modifier_rank=None`` means read-only: edits are dropped, as with DeepSpeed.

DeepSpeed's ZeRO-3 keeps an edit in the 16-bit partitions only, and its fp32 master partitions write
over it at the next step; here the edit is in the masters, so training continues from the edited weights.

Which engine owns a parameter is kept in a side table (:data:`OWNERS`) that :func:`register` fills at
``initialize()``; weak on both sides, so it holds neither the parameters nor the engines alive.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary  # keyed by identity: tensors' == is elementwise

OWNERS = WeakIdKeyDictionary()
"""Parameter -> weak reference to the engine that owns it (filled by :func:`register`)."""


def register(engine: Any) -> None:
    """Record ``engine`` as the owner of its module's parameters (called by ``initialize()``)."""
    ref = weakref.ref(engine)
    for param in engine.module.parameters():
        OWNERS[param] = ref


def unregister(engine: Any) -> None:
    """Forget ``engine`` as the owner of its module's parameters (``engine.destroy()``): they are whole again."""
    for param in engine.module.parameters():
        ref = OWNERS.get(param)
        if ref is not None and ref() is engine:
            del OWNERS[param]


def as_param_list(params: Any) -> list[nn.Parameter]:
    """DeepSpeed's accepted forms: one tensor, or an iterable of them (None entries skipped), deduplicated."""
    items: Iterable = [params] if isinstance(params, torch.Tensor) else (params or [])
    unique: dict[int, nn.Parameter] = {}
    for item in items:
        if item is None:
            continue
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"GatheredParameters: expected parameters (tensors), got {type(item).__name__}")
        unique.setdefault(id(item), item)
    return list(unique.values())


def broadcast_values(tensors: list[torch.Tensor], source: int, group: Any) -> None:
    """Every rank takes ``source``'s values (a global rank); host tensors travel through the device under NCCL."""
    if group is None or dist.get_world_size(group) == 1:
        return
    through_device = dist.get_backend(group) == "nccl"
    for tensor in tensors:
        staged = tensor.data.cuda() if through_device and not tensor.is_cuda else tensor.data
        dist.broadcast(staged, src=source, group=group)
        if staged is not tensor.data:
            tensor.data.copy_(staged)


class EngineEdit:
    """One engine's part of a ``GatheredParameters`` context (see the module docstring).

    Args:
        engine: the owning :class:`~angelptm.engine.engine.Engine`.
        params: its parameters named in the context.
    """

    def __init__(self, engine: Any, params: list[nn.Parameter]) -> None:
        self.engine = engine
        self.params = params
        canonical = {id(p): name for name, p in engine.module.named_parameters()}
        held = set(engine.optimizer.names) if engine.optimizer is not None else set()
        self.names = [canonical[id(p)] for p in params]
        self.trained = [name in held for name in self.names]
        """Whether each parameter has a master in the optimizer (frozen ones are whole in the module)."""
        self._bound: list[torch.Tensor] = []
        self._before: list[torch.Tensor | None] = []

    def enter(self) -> None:
        """Rebind every trained parameter to a whole copy of its master in the compute dtype (a collective when
        the masters are sharded).

        Raises:
            ValueError: between ``backward()`` and ``step()`` under ZeRO-Cache, which keeps that window's
                gradients where rewritten weights would go, and may have begun the update from them (host
                chunks update during backward), so neither the weights before the step nor after it are whole.
        """
        if self.engine.optimizer is not None and self.engine.optimizer.gradients_pending:
            raise ValueError("GatheredParameters between backward() and step() under zero_cache: this window's "
                             "gradients are held where the weights would be rewritten, and host chunks may already be "
                             "updating from them; enter the context after engine.step() or before the backward")
        names = [name for name, trained in zip(self.names, self.trained) if trained]
        masters = self._read_masters(names) if names else {}
        for param, name, trained in zip(self.params, self.names, self.trained):
            self._bound.append(param.data)
            if not trained:
                self._before.append(None)
                continue
            whole = masters[name].to(device=self.engine.device, dtype=param.dtype).view(param.shape)
            param.data = whole
            self._before.append(whole.clone())

    def _read_masters(self, names: list[str]) -> dict[str, torch.Tensor]:
        optimizer = self.engine.optimizer
        optimizer.finish_pending()
        values = optimizer.master_values(names)
        if self.engine.zero_cache_shards > 1:  # each rank reads the masters of the chunks it owns
            parts: list[Any] = [None] * self.engine.world_size
            dist.all_gather_object(parts, values, group=self.engine.ctx.group)
            values = {name: tensor for part in parts for name, tensor in part.items()}
        return values

    def exit(self, modifier_rank: int | None) -> None:
        """Keep the modifier's edits in the masters and the engine's copies (``modifier_rank`` None: drop them),
        then bind each parameter back to the engine's storage."""
        edited = [param.data for param in self.params]
        for param, bound in zip(self.params, self._bound):
            param.data = bound
        if modifier_rank is None:
            return
        group = self.engine.ctx.group
        source = dist.get_global_rank(group, modifier_rank) if group is not None else modifier_rank
        broadcast_values(edited, source, group)
        changed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (edited value, mask of changed elements)
        with torch.no_grad():
            for param, name, new, before in zip(self.params, self.names, edited, self._before):
                if before is None:  # frozen: the module's own tensor is the engine's copy
                    if new.data_ptr() != param.data.data_ptr():
                        param.data.copy_(new)
                    continue
                mask = new.ne(before)
                if bool(mask.any()):
                    changed[name] = (new, mask)
        if changed:
            self._write_masters(changed)

    def _write_masters(self, changed: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        optimizer = self.engine.optimizer
        current = optimizer.master_values(list(changed))  # this rank's owned ones (all, unless sharded)
        updates = {}
        for name, master in current.items():
            new, mask = changed[name]
            master = master.view(new.shape).clone()
            master[mask.cpu()] = new[mask].float().cpu()
            updates[name] = master
        optimizer.set_master_values(updates, names=list(changed))
