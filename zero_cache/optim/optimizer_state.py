"""The checkpoint surface of the hybrid optimizer: fp32 masters and Adam moments by parameter name.

States are read and written chunk by chunk through :meth:`ChunkStore.open_states` (an NVMe group is
read into a bounce buffer, and written back when loading). Sharded over ranks, each rank covers the
chunks it owns: a checkpoint's states are keyed by parameter name, so a rank takes whichever names
it owns at load time, at any world size.
"""

from __future__ import annotations

import itertools
from typing import Any, Collection

import torch

from zero_cache.storage.chunks import STATE_FIELDS


class OptimizerCheckpoint:
    """Mixed into :class:`~zero_cache.optim.optimizer.ZeroCacheOptimizer`, whose ``store``, ``optimizer``,
    ``members``, ``names``, ``step_count``, ``loss_scaler``, ``finish_pending`` and ``_restore_params``
    it uses."""

    def _chunk_states(self, *, write_back: bool = False, names: Collection[str] | None = None):
        """(slots, states) per chunk; the states are in memory while the caller holds them (NVMe: read, and
        written back with ``write_back``). Synchronous, one chunk at a time. ``names``: only the chunks
        holding these parameters, and only their slots."""
        self.finish_pending()
        for chunk, members in sorted(self._members_of_chunk.items()):
            slots = [slot for _, slot in members if names is None or slot.name in names]
            if not slots or not self.store.state_home(chunk).owned:
                continue
            with self.store.open_states(chunk, write_back=write_back) as states:
                yield slots, states

    def _read_fields(self, fields: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
        """{field: {parameter name: a CPU copy}} for the optimizer fields in ``fields``."""
        out: dict[str, dict[str, torch.Tensor]] = {f: {} for f in fields}
        for slots, states in self._chunk_states():
            for slot in slots:
                for f in fields:
                    out[f][slot.name] = self.store.state_view(slot, f, states).detach().cpu().clone()
        return out

    @property
    def owned_names(self) -> list[str]:
        """Parameters whose optimizer state this rank holds (all of them unless sharded)."""
        return [slot.name for _, slot in self.members if self.store.state_home(slot.chunk).owned]

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 masters by name (sharded: of the owned parameters only)."""
        masters = self._read_fields(("master",))["master"]
        return {name: masters[name].view(shape) for name, shape in self._owned_shapes()}

    def _owned_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        owned = set(self.owned_names)
        return [(slot.name, slot.shape) for _, slot in self.members if slot.name in owned]

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load fp32 masters by name; sharded, each rank takes its owned ones (``state`` may hold more)."""
        missing = [name for name in self.owned_names if name not in state]
        if missing:
            raise KeyError(f"checkpoint lacks master weights for {missing[:5]}")
        with torch.no_grad():
            for slots, states in self._chunk_states(write_back=True):
                for slot in slots:
                    self.store.state_view(slot, "master", states).copy_(state[slot.name].reshape(-1))
            self._restore_params(frozenset(self.names))
        self.finish_pending()

    def master_values(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """fp32 masters (shaped CPU copies) of the named parameters this rank owns; reads only their chunks."""
        wanted = set(names)
        return {slot.name: self.store.state_view(slot, "master", states).detach().cpu().clone().view(slot.shape)
                for slots, states in self._chunk_states(names=wanted) for slot in slots}

    def set_master_values(self, values: dict[str, torch.Tensor], *, names: Collection[str] | None = None) -> None:
        """Write the fp32 masters of the owned parameters in ``values``, then rewrite the compute copies of
        ``names`` (default: those in ``values``; sharded, the other ranks' come back from their owners) from
        their masters. Every rank calls it when the params are sharded."""
        with torch.no_grad():
            for slots, states in self._chunk_states(write_back=True, names=set(values)):
                for slot in slots:
                    self.store.state_view(slot, "master", states).copy_(values[slot.name].reshape(-1))
            self._restore_params(frozenset(names if names is not None else values))
        self.finish_pending()

    def refresh_masters_from_params(self) -> None:
        with torch.no_grad():
            for slots, states in self._chunk_states(write_back=True):
                with self.store.open_params(slots[0].chunk) as values:  # (a home on NVMe: read in)
                    for slot in slots:
                        master = self.store.state_view(slot, "master", states)
                        master.copy_(values[slot.offset:slot.offset + slot.numel])

    def state_dict(self) -> dict[str, Any]:
        fields = self._read_fields(STATE_FIELDS)
        masters = fields.pop("master")
        hypers = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        # speculate_next: whether the next step updates during backward (a clipped step predicts another; kept so
        # a resumed run takes the same path, bit for bit).
        return {"optimizer": {"step": self.step_count, "param_groups": hypers, "speculate_next": self._speculating,
                              **fields},
                "masters": {name: masters[name].view(shape) for name, shape in self._owned_shapes()},
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        self.load_master_state_dict(state["masters"])
        if not load_optimizer_states:
            return
        saved = state["optimizer"]
        self.step_count = saved["step"]
        self._speculating = self.update_in_backward and saved.get("speculate_next", True)
        for group, hyper in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update(hyper)
        with torch.no_grad():
            for slots, states in self._chunk_states(write_back=True):
                for slot, field in itertools.product(slots, ("exp_avg", "exp_avg_sq")):
                    self.store.state_view(slot, field, states).copy_(saved[field][slot.name])
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
