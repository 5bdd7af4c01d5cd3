"""Cost model of a pipeline stage: time per micro-batch and peak memory, over a chain of op units.

The chain is the model's operator sequence cut into *units*: runs of ops between two positions where the
graph may be cut (few tensors cross). A stage is a contiguous range of units ``[a, b)``. Everything here
is pure arithmetic on plain dataclasses (numpy for vectorising over the stage start ``a``), so the
partition search and its brute-force check share one definition of cost.

Per micro-batch, stage ``[a, b)`` takes (Narayanan et al. 2019, PipeDream; Fan et al. 2021, DAPPLE)::

    T = F + B + R + (x_in + x_out) / bandwidth
        F, B  = summed forward / backward op times of the units
        R     = F when recompute is on (the backward re-runs the forward), else 0
        x_in  = bytes crossing the stage's first cut (gradients sent back), 0 for the first stage
        x_out = bytes crossing its last cut (activations sent on), 0 for the last stage

and holds in memory::

    weights + state_bytes_per_param * numel + in_flight * activations          (no recompute)
    weights + state_bytes_per_param * numel + in_flight * x_in + activations   (recompute: only inputs kept)

with ``in_flight`` the micro-batches whose activations a stage keeps under the schedule: GPipe keeps all
M; 1F1B keeps min(S - s, M) at stage s (Narayanan et al. 2021); interleaved 1F1B keeps Megatron's warm-up
count (S - r - 1) * 2 + (v - 1) * S, plus one, spread over the rank's v chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopipe.config import SCHEDULES, AutoPipeConfig


@dataclass(frozen=True, slots=True)
class CostChain:
    """Measured costs of the units of a model's op sequence, in execution order.

    ``boundary_bytes`` has one more entry than the units: entry ``i`` is what crosses into unit ``i``
    from unit ``i - 1`` (entry 0: the pipeline's inputs; entry n: what the last unit hands to the loss).
    """

    forward_s: tuple[float, ...]
    """Forward time of each unit for one micro-batch."""
    backward_s: tuple[float, ...]
    """Backward time of each unit for one micro-batch."""
    param_bytes: tuple[int, ...]
    """Bytes of the parameters each unit owns (counted at their first use)."""
    param_numel: tuple[int, ...]
    """Elements of those parameters."""
    activation_bytes: tuple[int, ...]
    """Bytes of the tensors each unit allocates in forward for one micro-batch (kept for backward)."""
    boundary_bytes: tuple[int, ...]
    """Bytes crossing the cut before each unit, and after the last (length num_units + 1)."""
    unit_layer: tuple[int, ...] = ()
    """Layer of each unit's first op, non-decreasing: -1 before the first layer (embeddings), 0..L-1 the
    repeated blocks, L after the last (head, loss). Empty = no layer structure known."""
    num_layers: int = 0
    """L, the number of repeated blocks."""

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if n == 0:
            raise ValueError("CostChain: needs at least one unit")
        for name in ("backward_s", "param_bytes", "param_numel", "activation_bytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"CostChain.{name}: expected {n} entries, got {len(getattr(self, name))}")
        if len(self.boundary_bytes) != n + 1:
            raise ValueError(f"CostChain.boundary_bytes: expected {n + 1} entries, got {len(self.boundary_bytes)}")
        if self.unit_layer and len(self.unit_layer) != n:
            raise ValueError(f"CostChain.unit_layer: expected {n} entries or none, got {len(self.unit_layer)}")
        if any(later < earlier for earlier, later in zip(self.unit_layer, self.unit_layer[1:])):
            raise ValueError("CostChain.unit_layer: must be non-decreasing along the chain")
        for name in ("forward_s", "backward_s", "param_bytes", "param_numel", "activation_bytes", "boundary_bytes"):
            if any(not value >= 0 for value in getattr(self, name)):
                raise ValueError(f"CostChain.{name}: values must be >= 0 (and not NaN)")

    @property
    def num_units(self) -> int:
        """Number of units (stages are contiguous ranges of them)."""
        return len(self.forward_s)


@dataclass(frozen=True, slots=True)
class CostSettings:
    """What the cost of a split depends on besides the measured chain."""

    num_stages: int
    """Ranks per pipeline (S)."""
    num_microbatches: int
    """Micro-batches per flush (M)."""
    schedule: str = "1f1b"
    """"gpipe", "1f1b" or "interleaved"."""
    virtual_stages_per_rank: int = 1
    """Chunks per rank (v); the search makes S * v chunks, chunk c runs on rank c % S."""
    memory_limit_bytes: float | None = None
    """Per-rank memory cap (None = unlimited); with v chunks each chunk gets limit / v."""
    link_bandwidth_bytes_per_s: float = 50e9
    """Bandwidth between neighbouring stages."""
    state_bytes_per_param: float = 16.0
    """Gradient and optimizer-state bytes per parameter."""
    recompute: bool = False
    """Stage-level activation checkpointing."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches", "virtual_stages_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"CostSettings.{name}: must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"CostSettings.schedule: must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.memory_limit_bytes is not None and not self.memory_limit_bytes > 0:
            raise ValueError(f"CostSettings.memory_limit_bytes: must be > 0 or None, got {self.memory_limit_bytes}")
        if not self.link_bandwidth_bytes_per_s > 0:
            raise ValueError("CostSettings.link_bandwidth_bytes_per_s: must be > 0, got "
                             f"{self.link_bandwidth_bytes_per_s}")

    @classmethod
    def from_config(cls, config: AutoPipeConfig, memory_limit_bytes: float | None = None) -> CostSettings:
        """The settings of an ``"autopipe"`` config section.

        Args:
            config: the section.
            memory_limit_bytes: used when the section leaves ``stage_memory_limit_bytes`` unset
                (e.g. the device's capacity).

        Returns:
            The settings.
        """
        limit = config.stage_memory_limit_bytes if config.stage_memory_limit_bytes is not None else memory_limit_bytes
        return cls(num_stages=config.num_stages, num_microbatches=config.num_microbatches, schedule=config.schedule,
                   virtual_stages_per_rank=config.virtual_stages_per_rank, memory_limit_bytes=limit,
                   link_bandwidth_bytes_per_s=config.link_bandwidth_bytes_per_s,
                   state_bytes_per_param=config.state_bytes_per_param, recompute=config.recompute)

    @property
    def num_chunks(self) -> int:
        """Stages of the model: S * v."""
        return self.num_stages * self.virtual_stages_per_rank

    @property
    def chunk_memory_limit_bytes(self) -> float:
        """The cap one chunk is held to (inf when unlimited)."""
        if self.memory_limit_bytes is None:
            return math.inf
        return self.memory_limit_bytes / self.virtual_stages_per_rank

    def in_flight_microbatches(self, chunk: int) -> float:
        """Micro-batches whose activations chunk ``chunk`` holds at its peak (see the module docstring)."""
        stages, micro, virtual = self.num_stages, self.num_microbatches, self.virtual_stages_per_rank
        if self.schedule == "gpipe":
            return float(micro)
        if self.schedule == "1f1b" or virtual == 1:
            return float(min(stages - chunk % stages, micro))
        rank = chunk % stages
        warmup = (stages - rank - 1) * 2 + (virtual - 1) * stages  # Megatron-LM's interleaved warm-up count
        return min(warmup + 1, micro * virtual) / virtual


class StageCostModel:
    """Time and memory of any stage ``[a, b)`` of a chain, from prefix sums.

    ``a`` may be an int or an integer numpy array (every candidate start at once); ``b`` is an int.

    Args:
        chain: the measured units.
        settings: schedule, limits and bandwidth.
    """

    def __init__(self, chain: CostChain, settings: CostSettings) -> None:
        self.chain = chain
        self.settings = settings
        self.num_units = chain.num_units

        def prefix(values: tuple) -> np.ndarray:
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))

        self._forward = prefix(chain.forward_s)
        self._backward = prefix(chain.backward_s)
        self._param_bytes = prefix(chain.param_bytes)
        self._param_numel = prefix(chain.param_numel)
        self._activation = prefix(chain.activation_bytes)
        self._boundary = np.asarray(chain.boundary_bytes, dtype=np.float64)

    def forward_s(self, a, b: int):
        """Summed forward time of units [a, b)."""
        return self._forward[b] - self._forward[a]

    def backward_s(self, a, b: int):
        """Backward time of units [a, b), plus the forward re-run when recompute is on."""
        extra = self.forward_s(a, b) if self.settings.recompute else 0.0
        return self._backward[b] - self._backward[a] + extra

    def comm_s(self, a, b: int):
        """Sends of one micro-batch: input gradients back (unless first) and outputs on (unless last)."""
        a = np.asarray(a)
        incoming = np.where(a > 0, self._boundary[a], 0.0)
        outgoing = self._boundary[b] if b < self.num_units else 0.0
        return (incoming + outgoing) / self.settings.link_bandwidth_bytes_per_s

    def time_s(self, a, b: int):
        """Time of stage [a, b) per micro-batch: F + B (+ recompute) + boundary transfers."""
        return self.forward_s(a, b) + self.backward_s(a, b) + self.comm_s(a, b)

    def memory_bytes(self, chunk: int, a, b: int):
        """Peak memory of stage [a, b) placed as chunk ``chunk``: weights, states and in-flight activations."""
        static = (self._param_bytes[b] - self._param_bytes[a]
                  + self.settings.state_bytes_per_param * (self._param_numel[b] - self._param_numel[a]))
        activations = self._activation[b] - self._activation[a]
        in_flight = self.settings.in_flight_microbatches(chunk)
        if self.settings.recompute:
            return static + in_flight * self._boundary[np.asarray(a)] + activations
        return static + in_flight * activations

    def feasible_time_s(self, chunk: int, a, b: int):
        """``time_s`` where the stage fits the chunk's memory cap, inf where it does not."""
        fits = self.memory_bytes(chunk, a, b) <= self.settings.chunk_memory_limit_bytes
        return np.where(fits, self.time_s(a, b), np.inf)
