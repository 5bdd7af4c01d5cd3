"""What a model's states take, worked out from its config by arithmetic, against what this machine has.

Two checks of :func:`angelptm.memory.fit_check.check_config_fits` live here:

* :func:`check_sizes_by_arithmetic`: the parameter count from the config's sizes alone, before any model (even a
  meta-device one, built layer by layer) exists. A count whose 16-bit weights alone exceed every byte of the
  machine (RAM, GPU memory and the NVMe tier's disk) is a typo, and is refused naming the sizes.
* :func:`check_states_fit`: without ZeRO-Cache every rank keeps a whole replica of the model states on its
  compute device (``angelptm.engine.mixed_precision``): the weights, an fp32 master of each low-precision one,
  the fp32 gradient buffer (and the low-precision gradient autograd makes first) and Adam's two fp32 moments.
  Those are counted against the device's free memory (host RAM on a CPU-only run), so a 1.57B model on a
  24 GiB host is refused by name instead of dying in ``torch.optim.Adam``'s first step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import torch

import zero_cache
from angelptm.config import EngineConfig
from angelptm.errors import ConfigError

STATES_SHARE_OF_FREE = 0.9
"""Model states may take at most this share of the free memory: activations and the allocator need the rest."""
WEIGHT_BYTES_AT_LEAST = 2
"""No engine keeps a weight in fewer bytes than a 16-bit one: the floor :func:`check_sizes_by_arithmetic` uses."""


def approx_num_params(cfg: EngineConfig) -> int:
    """The dense GPT's parameters from the config's sizes (biases and norms left out; MoE experts counted once):
    a lower bound of what :func:`angelptm.pretraining.models.build_model` makes."""
    model = cfg.model
    hidden, ffn, kv_width = model.hidden_size, model.ffn_hidden_size, model.num_kv_heads * model.head_dim
    matrices = 3 if model.mlp == "swiglu" else 2
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + matrices * hidden * ffn
    embeddings = model.vocab_size * hidden * (1 if model.tie_embeddings else 2)
    positions = model.max_seq_len * hidden if model.position == "learned" else 0
    return model.num_layers * per_layer + embeddings + positions


def check_sizes_by_arithmetic(cfg: EngineConfig, device: torch.device, world_size: int, ranks_per_host: int) -> None:
    """Refuse sizes whose weights alone outgrow every byte of the machine, before any model is built."""
    numel = approx_num_params(cfg)
    hosts = max(1, -(-world_size // ranks_per_host))
    per_host = psutil.virtual_memory().total
    if device.type == "cuda":
        per_host += torch.cuda.mem_get_info(device)[1] * ranks_per_host
    nvme = cfg.zero_cache.nvme_path if cfg.zero_cache.enabled else None
    if nvme and Path(nvme).is_dir():
        per_host += shutil.disk_usage(nvme).free
    capacity = per_host * hosts
    if numel * WEIGHT_BYTES_AT_LEAST <= capacity:
        return
    model = cfg.model
    raise ConfigError(
        f"model.num_layers {model.num_layers}, model.hidden_size {model.hidden_size}, model.ffn_hidden_size "
        f"{model.ffn_hidden_size} and model.vocab_size {model.vocab_size} make about {numel:.3g} parameters, whose "
        f"16-bit weights alone ({zero_cache.format_bytes(numel * WEIGHT_BYTES_AT_LEAST)}) exceed all the memory "
        f"and disk of this machine ({zero_cache.format_bytes(capacity)}); check these model.* sizes for a typo")


def state_bytes_per_param(cfg: EngineConfig) -> int:
    """Bytes per parameter the non-ZeRO-Cache engine keeps on its device (``angelptm.engine.mixed_precision``)."""
    compute = torch.tensor([], dtype=cfg.precision.dtype).element_size()
    low_precision = compute != 4
    weights = compute + (4 if low_precision else 0)  # an fp32 run's parameter is its own master
    gradients = 4 + (compute if low_precision else 0)  # the fp32 buffer, and autograd's gradient before it is folded
    optimizer = 0 if cfg.optimizer is None else 8 + (4 if cfg.optimizer.amsgrad else 0)
    return weights + gradients + optimizer


def check_states_fit(cfg: EngineConfig, numel: int, device: torch.device, ranks_per_host: int, what: str) -> None:
    """Without ZeRO-Cache: refuse states (a replica per rank) beyond the compute device's free memory."""
    per_param = state_bytes_per_param(cfg)
    need = numel * per_param
    if device.type == "cuda":
        free, where, sharing = torch.cuda.mem_get_info(device)[0], f"GPU {device}", need
    else:  # the ranks of a CPU host share its RAM
        free, where, sharing = psutil.virtual_memory().available, "host RAM", need * ranks_per_host
    if sharing <= free * STATES_SHARE_OF_FREE:
        return
    ranks = f" x {ranks_per_host} ranks" if sharing != need else ""
    raise ConfigError(
        f"{what} ({numel:,} parameters) needs {per_param} bytes per parameter without ZeRO-Cache (weights, fp32 "
        f"masters, gradients and Adam states in {str(cfg.precision.dtype).removeprefix('torch.')}): "
        f"{zero_cache.format_bytes(need)}{ranks}, but {where} has {zero_cache.format_bytes(free)} available; "
        "the optimizer's first step would end the run. Enable ZeRO-Cache (zero_cache.enabled: true spreads the "
        "states over the device, host memory and NVMe) or use a smaller model (model.*)")
