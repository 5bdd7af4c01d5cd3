"""The checkpoint surface of the hybrid optimizer: fp32 masters and Adam moments by parameter name.

States are read and written chunk by chunk through :meth:`ChunkStore.open_states` (an NVMe group is
read into a bounce buffer, and written back when loading). Sharded over ranks, each rank covers the
chunks it owns: a checkpoint's states are keyed by parameter name, so a rank takes whichever names
it owns at load time, at any world size.

:class:`NamedStates` does the reading and writing, given the store, the parameters in the optimizer's
order and two callbacks of the optimizer's; :class:`OptimizerCheckpoint` is the public face
(``ZeroCacheOptimizer``'s methods of the same names, and the type ``angelptm`` recognises the format by).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Collection, Mapping

import torch

from zero_cache.optim.state_snapshot import StateRef, StateSnapshot
from zero_cache.plan.layout import TensorSlot
from zero_cache.storage.chunks import STATE_FIELDS, ChunkStore


def trained_members(param_groups: list[dict[str, Any]], slots: list[TensorSlot], names: dict[int, str]
                    ) -> tuple[list[tuple[int, TensorSlot]], dict[int, list[tuple[int, TensorSlot]]]]:
    """(param-group index, slot) of every parameter that requires a gradient, in the optimizer's group order (the
    order a state dict lists them in); and the same by chunk. ``names``: id(parameter) -> its slot's name."""
    slot_of = {slot.name: slot for slot in slots}
    members = [(index, slot_of[names[id(param)]]) for index, group in enumerate(param_groups)
               for param in group["params"] if param.requires_grad]
    by_chunk: dict[int, list[tuple[int, TensorSlot]]] = {}
    for index, slot in members:
        by_chunk.setdefault(slot.chunk, []).append((index, slot))
    return members, by_chunk


def _file_order(table: Mapping[str, Any], name: str) -> tuple:
    """Sort key of ``table[name]``: where its tensor lies in its file, for a table that knows (``position``), so that
    a chunk's reads go through the file front to back; tensors already in memory first."""
    position = getattr(table, "position", None)
    where = position(name) if position is not None else None
    return (1, *where) if where is not None else (0,)


def _copy_state(out: torch.Tensor, table: Mapping[str, Any], name: str) -> None:
    """``out`` (a flat view of a state in its chunk) from ``table[name]``: read straight into it by a table that reads
    its tensors from a file (``read_into``), else copied."""
    read_into = getattr(table, "read_into", None)
    if read_into is not None:
        read_into(name, out)
    else:
        out.copy_(table[name].reshape(-1))


class NamedStates:
    """An optimizer's chunked states (masters, Adam moments) read and written by parameter name.

    Args:
        store: the chunk storage that holds the states.
        members: (param-group index, slot) of every trained parameter, in the optimizer's order (the order a
            state dict lists them in).
        members_of_chunk: the same members by chunk (the optimizer's own index of them).
        optimizer: the client's torch optimizer; only its ``param_groups`` (the hyperparameters) are read and
            loaded.
        loss_scaler: fp16 loss scaler saved and loaded beside the states, or None.
        settle: blocks until every update and copy in flight has landed (the optimizer's ``finish_pending``); run
            before the states are read and after masters are written.
        restore_params: rewrites the compute copies of the named parameters from their masters (given a frozenset
            of names; sharded, the other ranks' come back from their owners).
    """

    def __init__(self, store: ChunkStore, members: list[tuple[int, TensorSlot]],
                 members_of_chunk: dict[int, list[tuple[int, TensorSlot]]], *, optimizer: torch.optim.Optimizer,
                 loss_scaler: Any, settle: Callable[[], None], restore_params: Callable[[frozenset], None]) -> None:
        self.store = store
        self.members = members
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.settle = settle
        self.restore_params = restore_params
        self.members_of_chunk = members_of_chunk
        self._all_names = frozenset(slot.name for _, slot in members)
        self.snapshot: StateSnapshot | None = None
        """The states of a checkpoint still being written (:mod:`zero_cache.optim.state_snapshot`), or None."""

    def before_update(self, chunk: int) -> None:
        """Called before anything modifies ``chunk``'s states: a snapshot in progress stages it first."""
        snapshot = self.snapshot
        if snapshot is not None:
            snapshot.before_update(chunk)

    def begin_snapshot(self, *, max_staged: int, allocate: Callable[[int], torch.Tensor] | None = None
                       ) -> StateSnapshot:
        """Settle the states and start a snapshot of the owned chunks (see :class:`StateSnapshot`); the refs of
        :meth:`state_refs` and :meth:`weight_refs` are read from it. One at a time: the caller ends the previous one
        (:meth:`end_snapshot`) first."""
        assert self.snapshot is None or self.snapshot.finished(), "a snapshot is still staging"
        self.settle()
        chunks = [chunk for chunk, members in sorted(self.members_of_chunk.items())
                  if members and self.store.state_home(chunk).owned]
        self.snapshot = StateSnapshot(self.store, chunks, max_staged=max_staged, allocate=allocate)
        return self.snapshot

    def end_snapshot(self, snapshot: StateSnapshot) -> None:
        """Forget ``snapshot`` (written or given up) and free its buffers."""
        snapshot.release()
        if self.snapshot is snapshot:
            self.snapshot = None

    @staticmethod
    def _ref(slot: TensorSlot, field: str, *, shaped: bool) -> StateRef:
        """``shaped``: in the parameter's shape (the masters), else flat (the moments, as :meth:`state_dict` has
        them)."""
        return StateRef(field=field, name=slot.name, chunk=slot.chunk, offset=slot.offset, numel=slot.numel,
                        shape=tuple(slot.shape) if shaped else (slot.numel,))

    def _owned_slots(self) -> list[TensorSlot]:
        return [slot for _, slot in self.members if self.store.state_home(slot.chunk).owned]

    def state_refs(self, *, step: int, speculate_next: bool) -> dict[str, Any]:
        """:meth:`state_dict` with a :class:`StateRef` for each state tensor (read later from the snapshot); the
        small values (step, hyperparameters, loss scale) are the current ones."""
        slots = self._owned_slots()
        hypers = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        moments = {field: {slot.name: self._ref(slot, field, shaped=False) for slot in slots}
                   for field in ("exp_avg", "exp_avg_sq")}
        return {"optimizer": {"step": step, "param_groups": hypers, "speculate_next": speculate_next, **moments},
                "masters": {slot.name: self._ref(slot, "master", shaped=True) for slot in slots},
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}

    def _chunk_states(self, *, write_back: bool = False, names: Collection[str] | None = None):
        """(slots, states) per chunk; the states are in memory while the caller holds them (NVMe: read, and
        written back with ``write_back``). Synchronous, one chunk at a time. ``names``: only the chunks
        holding these parameters, and only their slots."""
        self.settle()
        for chunk, members in sorted(self.members_of_chunk.items()):
            slots = [slot for _, slot in members if names is None or slot.name in names]
            if not slots or not self.store.state_home(chunk).owned:
                continue
            if write_back:
                self.before_update(chunk)
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
        self._load_tables({"master": state})

    def _load_tables(self, tables: dict[str, Mapping[str, Any]]) -> None:
        """Load each field's name table (``{"master": ..., "exp_avg": ...}``) into the owned chunks, then rewrite the
        compute copies from the masters (``tables`` holds them).

        One pass over the chunks, each opened once (an NVMe group is read and written back once, not once per
        field), every table checked for every owned name before anything is written. A table that reads its tensors
        from a file (a checkpoint's lazily loaded states) reads each straight into its place in the chunk
        (``read_into``), in the file's order (``position``): the records of a chunk's three fields lie together, so
        the file is read front to back.
        """
        owned = self.owned_names
        for field, table in tables.items():
            missing = [name for name in owned if name not in table]
            if missing:
                what = "master weights" if field == "master" else f"{field} states"
                raise KeyError(f"checkpoint lacks {what} for {missing[:5]}")
        with torch.no_grad():
            for slots, states in self._chunk_states(write_back=True):
                reads = sorted(itertools.product(slots, tables), key=lambda read: _file_order(tables[read[1]],
                                                                                              read[0].name))
                for slot, field in reads:
                    _copy_state(self.store.state_view(slot, field, states), tables[field], slot.name)
            if "master" in tables:
                self.restore_params(self._all_names)
        self.settle()

    def master_values(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """fp32 masters (shaped CPU copies) of the named parameters this rank owns; reads only their chunks."""
        wanted = set(names)
        return {slot.name: self.store.state_view(slot, "master", states).detach().cpu().clone().view(slot.shape)
                for slots, states in self._chunk_states(names=wanted) for slot in slots}

    def set_master_values(self, values: dict[str, torch.Tensor], *, names: Collection[str] | None = None) -> None:
        """See :meth:`OptimizerCheckpoint.set_master_values`."""
        with torch.no_grad():
            for slots, states in self._chunk_states(write_back=True, names=set(values)):
                for slot in slots:
                    self.store.state_view(slot, "master", states).copy_(values[slot.name].reshape(-1))
            self.restore_params(frozenset(names if names is not None else values))
        self.settle()

    def refresh_masters_from_params(self) -> None:
        """Copy each owned parameter's compute values into its fp32 master (after the weights were loaded into the
        module directly)."""
        with torch.no_grad():
            for slots, states in self._chunk_states(write_back=True):
                with self.store.open_params(slots[0].chunk) as values:  # (a home on NVMe: read in)
                    for slot in slots:
                        master = self.store.state_view(slot, "master", states)
                        master.copy_(values[slot.offset:slot.offset + slot.numel])

    def state_dict(self, *, step: int, speculate_next: bool) -> dict[str, Any]:
        """The states by name, with the optimizer's ``step`` and whether its next step updates during backward."""
        fields = self._read_fields(STATE_FIELDS)
        masters = fields.pop("master")
        hypers = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        return {"optimizer": {"step": step, "param_groups": hypers, "speculate_next": speculate_next, **fields},
                "masters": {name: masters[name].view(shape) for name, shape in self._owned_shapes()},
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> tuple[int, bool] | None:
        """Load the masters, and with ``load_optimizer_states`` the hyperparameters, moments and loss scale.

        Returns:
            The saved (step, speculate_next) for the optimizer to resume with; None without optimizer states.
        """
        if not load_optimizer_states:
            self.load_master_state_dict(state["masters"])
            return None
        saved = state["optimizer"]
        self._load_tables({"master": state["masters"], "exp_avg": saved["exp_avg"], "exp_avg_sq": saved["exp_avg_sq"]})
        for group, hyper in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update(hyper)
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        return saved["step"], saved.get("speculate_next", True)


class OptimizerCheckpoint:
    """The checkpoint surface of :class:`~zero_cache.optim.optimizer.ZeroCacheOptimizer`, which inherits it: each
    method hands over to the optimizer's :class:`NamedStates` (``named_states``).

    Kept a base class rather than folded into the optimizer because ``angelptm`` tells the two checkpoint formats
    apart by it (``isinstance(optimizer, OptimizerCheckpoint)``). Beside ``named_states`` it reads and writes only
    the optimizer's step state: ``step_count``, ``update_in_backward`` and ``speculating``.
    """

    named_states: NamedStates

    @property
    def owned_names(self) -> list[str]:
        """Parameters whose optimizer state this rank holds (all of them unless sharded)."""
        return self.named_states.owned_names

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 masters by name (sharded: of the owned parameters only)."""
        return self.named_states.master_state_dict()

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load fp32 masters by name; sharded, each rank takes its owned ones (``state`` may hold more)."""
        self.named_states.load_master_state_dict(state)

    def master_values(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """fp32 masters (shaped CPU copies) of the named parameters this rank owns; reads only their chunks."""
        return self.named_states.master_values(names)

    def set_master_values(self, values: dict[str, torch.Tensor], *, names: Collection[str] | None = None) -> None:
        """Write the fp32 masters of the owned parameters in ``values``, then rewrite the compute copies of
        ``names`` (default: those in ``values``; sharded, the other ranks' come back from their owners) from
        their masters. Every rank calls it when the params are sharded."""
        self.named_states.set_master_values(values, names=names)

    def refresh_masters_from_params(self) -> None:
        """Copy each owned parameter's compute values into its fp32 master."""
        self.named_states.refresh_masters_from_params()

    def state_refs(self) -> dict[str, Any]:
        """:meth:`state_dict` with :class:`~zero_cache.optim.state_snapshot.StateRef` in place of the state tensors,
        for a checkpoint streamed from :meth:`begin_snapshot`'s snapshot."""
        return self.named_states.state_refs(step=self.step_count, speculate_next=self.speculating)

    def begin_snapshot(self, *, max_staged: int, allocate: Callable[[int], torch.Tensor] | None = None
                       ) -> StateSnapshot:
        """Settle and snapshot the owned states for a checkpoint
        (:class:`~zero_cache.optim.state_snapshot.StateSnapshot`): staged at most ``max_staged`` chunks at a time, each
        chunk before the step first modifies it."""
        return self.named_states.begin_snapshot(max_staged=max_staged, allocate=allocate)

    def end_snapshot(self, snapshot: StateSnapshot) -> None:
        """Forget a snapshot that was written (or given up)."""
        self.named_states.end_snapshot(snapshot)

    def state_dict(self) -> dict[str, Any]:
        # speculate_next: whether the next step updates during backward (a clipped step predicts another; kept so
        # a resumed run takes the same path, bit for bit).
        return self.named_states.state_dict(step=self.step_count, speculate_next=self.speculating)

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        resumed = self.named_states.load_state_dict(state, load_optimizer_states=load_optimizer_states)
        if resumed is not None:
            self.step_count, speculate_next = resumed
            self.speculating = self.update_in_backward and speculate_next
