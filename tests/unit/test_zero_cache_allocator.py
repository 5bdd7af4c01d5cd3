"""The CUDA allocator's expandable segments under ZeRO-Cache (zero_cache.storage.tiers.use_expandable_segments), on
CPU."""

from __future__ import annotations

import pytest
import torch

from zero_cache.storage.tiers import ALLOC_CONF_VARIABLES, use_expandable_segments

CUDA = torch.device("cuda", 0)


@pytest.fixture
def settings(monkeypatch) -> list[str]:
    """What the allocator is told (a fake setter; the environment's allocator options cleared)."""
    told: list[str] = []
    for name in ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", told.append, raising=False)
    return told


def test_expandable_segments_are_turned_on_when_nobody_chose(settings):
    assert use_expandable_segments(CUDA) == "turned on"
    assert settings == ["expandable_segments:True"]


@pytest.mark.parametrize("variable", ALLOC_CONF_VARIABLES)
@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:128,expandable_segments:True"])
def test_the_environments_choice_stands(settings, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    assert use_expandable_segments(CUDA).startswith(f"left as the environment sets it ({value}")
    assert settings == []


def test_an_allocator_without_the_option_is_reported(monkeypatch, settings):
    def refuse(value: str) -> None:
        raise RuntimeError("Unrecognized key 'expandable_segments'")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    assert "unavailable (Unrecognized key 'expandable_segments')" in use_expandable_segments(CUDA)


def test_nothing_is_set_off_cuda(settings):
    assert use_expandable_segments(torch.device("cpu")) == "not a CUDA device" and settings == []
