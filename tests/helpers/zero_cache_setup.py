"""Shared by the ZeRO-Cache engine tests: a six-layer model and budgets that force a device/host split."""

from __future__ import annotations

import torch
from reference import SEQ, VOCAB, ds_config

import angelptm
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.plan.layout import pack

# Bytes of model state per chunk element: the param, then fp32 master + exp_avg + exp_avg_sq; with
# one micro-batch per step gradients are written over the params and take no bytes of their own,
# while accumulating micro-batches add an fp32 accumulator.
BF16_BYTES_PER_ELEMENT = 2 + 12
FP32_BYTES_PER_ELEMENT = 4 + 12 + 4
CHUNK_NUMEL = 8192


def six_layer_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=6,
                                   hidden_size=32, num_heads=4))


def budgets(model: torch.nn.Module, bytes_per_element: int = BF16_BYTES_PER_ELEMENT) -> tuple[int, int]:
    """A device budget 4x smaller than the model states, and a host budget that cannot hold them alone."""
    layout = pack([(n, tuple(p.shape)) for n, p in model.named_parameters()], CHUNK_NUMEL)
    total = layout.num_chunks * layout.chunk_numel * bytes_per_element
    return total // 4, int(total * 0.9)


def zero_cache_config(device_budget: int, host_budget: int, *, clip: float = 1.0, **overrides) -> dict:
    config = ds_config(bf16={"enabled": True}, gradient_clipping=clip,
                       zero_cache={"enabled": True, "device_memory_budget": device_budget,
                                   "host_memory_budget": host_budget, "chunk_size": CHUNK_NUMEL})
    config.update(overrides)
    return config


def resident_engine(seed: int, *, clip: float = 1.0, **zero_cache):
    """:func:`six_layer_llama` under :func:`budgets`, params resident on the device (streamed ones:
    ``test_zero_cache_streamed.py``), ``zero_cache`` settings on top; returns (engine, optimizer)."""
    config = zero_cache_config(*budgets(six_layer_llama(seed)), clip=clip)
    config["zero_cache"].update(param_home="device", **zero_cache)
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    return engine, optimizer
