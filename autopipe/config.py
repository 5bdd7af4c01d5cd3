"""Typed configuration of AutoPipe (the ``"autopipe"`` section of the JSON config)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(kw_only=True, slots=True)
class AutoPipeConfig:
    """Operator-level profiling and balanced pipeline-stage partitioning."""

    enabled: bool = False
    """Train with a pipeline whose stage boundaries come from the partition search."""

    num_stages: int = 2
    """Pipeline stages (ranks per pipeline); the data-parallel degree is world_size / num_stages."""

    num_microbatches: int = 4
    """Micro-batches per pipeline flush; more shrinks the bubble, (S-1)/(M+S-1) for GPipe and 1F1B."""

    schedule: str = "1f1b"
    """"gpipe", "1f1b" or "interleaved"."""

    virtual_stages_per_rank: int = 1
    """Model chunks per rank for the interleaved schedule (1 otherwise)."""

    profile_path: str | None = None
    """Read the op profile from this JSON instead of profiling at start-up."""

    stage_memory_limit_bytes: int | None = None
    """Per-stage memory cap for the search; None = the device's capacity (no cap on CPU)."""

    link_bandwidth_bytes_per_s: float = 50e9
    """Bandwidth between neighbouring stages, for the boundary-transfer term of the cost model."""

    state_bytes_per_param: float = 16.0
    """Bytes per parameter besides the weight itself: gradient + optimizer states (fp32 grad, master,
    exp_avg, exp_avg_sq = 16 for mixed-precision Adam)."""

    max_cut_tensors: int = 2
    """Cut the op sequence only where at most this many tensors cross (fewer sends, fewer candidates)."""

    recompute: bool = False
    """Stage-level activation checkpointing: keep only each stage's inputs per in-flight micro-batch and
    re-run the stage's forward in its backward (the cost model adds one forward to the backward)."""

    profile_warmup: int = 2
    """Untimed runs of each op before timing."""

    profile_repeats: int = 5
    """Timed runs of each op (forward and backward); the median is kept."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches", "virtual_stages_per_rank", "max_cut_tensors",
                     "profile_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"autopipe.{name}: must be an integer >= 1, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"autopipe.schedule: must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule != "interleaved" and self.virtual_stages_per_rank != 1:
            raise ValueError("autopipe.virtual_stages_per_rank > 1 needs schedule 'interleaved'")
        if self.stage_memory_limit_bytes is not None and self.stage_memory_limit_bytes <= 0:
            raise ValueError(f"autopipe.stage_memory_limit_bytes: must be > 0, got {self.stage_memory_limit_bytes}")
        if not self.link_bandwidth_bytes_per_s > 0:
            raise ValueError(f"autopipe.link_bandwidth_bytes_per_s: must be > 0, got {self.link_bandwidth_bytes_per_s}")
        if self.state_bytes_per_param < 0:
            raise ValueError(f"autopipe.state_bytes_per_param: must be >= 0, got {self.state_bytes_per_param}")
        if self.profile_warmup < 0:
            raise ValueError(f"autopipe.profile_warmup: must be >= 0, got {self.profile_warmup}")

    @property
    def num_chunks(self) -> int:
        """Model chunks in the whole pipeline: num_stages * virtual_stages_per_rank."""
        return self.num_stages * self.virtual_stages_per_rank

    def bubble_fraction(self) -> float:
        """Idle share of a flush for the configured schedule: (S-1) / (v*M + S-1) (Narayanan et al. 2021)."""
        stages, micro, virtual = self.num_stages, self.num_microbatches, self.virtual_stages_per_rank
        return (stages - 1) / (virtual * micro + stages - 1)
