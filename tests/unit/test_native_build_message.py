"""A native op's first build is announced (issue 28: the test run sat silent for minutes while it compiled)."""

from __future__ import annotations

import logging

import torch.utils.cpp_extension

from zero_cache.runtime import native


def test_a_build_is_announced_and_a_cached_one_is_not(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # torch's extension cache, empty
    monkeypatch.setattr(logging.getLogger("zero_cache.runtime.native"), "handlers", [])  # conftest's would print it too
    built = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, **_: built.append(name) or name)
    with caplog.at_level(logging.INFO, logger="zero_cache.runtime.native"):
        assert native.load_csrc.__wrapped__("fused_host_adam") == "angelptm_fused_host_adam"
    assert any("compiling fused_host_adam.cpp" in record.message for record in caplog.records)

    cache = tmp_path / "angelptm_fused_host_adam"
    cache.mkdir(exist_ok=True)  # torch made it when asked where the build goes
    (cache / "angelptm_fused_host_adam.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero_cache.runtime.native"):
        native.load_csrc.__wrapped__("fused_host_adam")
    assert not caplog.records and built == ["angelptm_fused_host_adam"] * 2
