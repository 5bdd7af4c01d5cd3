"""Lazy reads of a checkpoint's state tables (:mod:`angelptm.checkpoints.lazy_states`), on a torch whose file reader
has the record sizes and on one without (``PyTorchFileReader.get_record_size`` is missing from torch builds users
run: the GPU images' torch raised "'PyTorchFileReader' object has no attribute 'get_record_size'" at the first
background-saved checkpoint's load)."""

from __future__ import annotations

import pytest
import torch

from angelptm.checkpoints import lazy_states


class _ReaderWithoutRecordSizes:
    """torch's reader as the older builds have it: everything but ``get_record_size``."""

    def __init__(self, handle) -> None:
        self._reader = _REAL_READER(handle)

    def __getattr__(self, name: str):
        if name == "get_record_size":
            raise AttributeError(name)
        return getattr(self._reader, name)


_REAL_READER = torch._C.PyTorchFileReader


@pytest.mark.parametrize("record_sizes", [True, False], ids=["reader-with-sizes", "reader-without-sizes"])
def test_state_tables_read_lazily_equal_what_was_saved(tmp_path, monkeypatch, record_sizes):
    generator = torch.Generator().manual_seed(7)
    tables = {name: {f"layer{i}.weight": torch.randn(5 + i, 3, generator=generator) for i in range(3)}
              for name in lazy_states.STATE_TABLES}
    tables["masters"]["strided"] = torch.randn(6, 4, generator=generator).t()  # a view with strides of its own
    saved = {"optimizer": {**tables, "step": 11}}
    path = tmp_path / "optim_states.pt"
    torch.save(saved, path)
    if not record_sizes:
        monkeypatch.setattr(torch._C, "PyTorchFileReader", _ReaderWithoutRecordSizes)
    loaded = lazy_states.load_lazily(path)["optimizer"]
    assert loaded["step"] == 11
    for name in lazy_states.STATE_TABLES:
        assert isinstance(loaded[name], lazy_states.LazyTensors)
        for key, expected in tables[name].items():
            assert torch.equal(loaded[name][key], expected), (name, key)
