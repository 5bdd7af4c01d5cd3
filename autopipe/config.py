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
    """Per-stage memory cap for the search; None = the device's capacity."""

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"autopipe.num_stages: must be >= 1, got {self.num_stages}")
        if self.num_microbatches < 1:
            raise ValueError(f"autopipe.num_microbatches: must be >= 1, got {self.num_microbatches}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"autopipe.schedule: must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.virtual_stages_per_rank < 1:
            raise ValueError(f"autopipe.virtual_stages_per_rank: must be >= 1, got {self.virtual_stages_per_rank}")
        if self.schedule != "interleaved" and self.virtual_stages_per_rank != 1:
            raise ValueError("autopipe.virtual_stages_per_rank > 1 needs schedule 'interleaved'")
        if self.stage_memory_limit_bytes is not None and self.stage_memory_limit_bytes <= 0:
            raise ValueError(f"autopipe.stage_memory_limit_bytes: must be > 0, got {self.stage_memory_limit_bytes}")

    def bubble_fraction(self) -> float:
        """Idle share of a flush for the configured schedule: (S-1) / (v*M + S-1) (Narayanan et al. 2021)."""
        stages, micro, virtual = self.num_stages, self.num_microbatches, self.virtual_stages_per_rank
        return (stages - 1) / (virtual * micro + stages - 1)
