"""What a placement costs one step besides compute: PCIe bytes each way and CPU Adam (pure arithmetic).

The planner compares placements by this estimate. Transfers in both directions and the host's
Adam run on their own streams and thread beside the GPU's compute, so each is a floor under the
step time and the step is bound by the largest of them (or by compute, which no placement
changes). The rates are the lent H200's, measured as DESIGN.md records (pinned copies 51 GiB/s
each way; DeepSpeedCPUAdam 4.3 G params/s on 16 cores): only their ratio matters to the choice,
and on that machine a chunk's CPU Adam costs about six one-way copies of its bf16 params, so a
device byte is worth more as a resident param shard than as an eighth of an optimizer group
only while the shard's copies stay cheaper than that.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_cache.units import format_bytes

PCIE_BYTES_PER_S = 51 * 2**30
"""Pinned host <-> device copies, each direction."""
HOST_ADAM_ELEMENTS_PER_S = 4.3e9
"""CPU Adam over fp32 masters and moments."""


@dataclass(frozen=True, slots=True)
class StepTraffic:
    """Bytes one step moves between host and device, and elements its host updates."""

    h2d_bytes: int = 0
    """Streamed shards copied in on use, and updated params of host-updated chunks copied back in."""
    d2h_bytes: int = 0
    """Gradients of host-updated chunks, to their staging buffer or their shard's home."""
    host_adam_elements: int = 0
    """Elements of the chunks whose optimizer group is on the host or NVMe."""

    @property
    def seconds(self) -> float:
        """The floor this traffic puts under the step: its slowest stream."""
        return max(self.h2d_bytes / PCIE_BYTES_PER_S, self.d2h_bytes / PCIE_BYTES_PER_S,
                   self.host_adam_elements / HOST_ADAM_ELEMENTS_PER_S)

    def describe(self) -> str:
        return (f"H2D {format_bytes(self.h2d_bytes)}, D2H {format_bytes(self.d2h_bytes)}, host Adam over "
                f"{_count(self.host_adam_elements)} elements (at least {self.seconds:.3f} s at "
                f"{PCIE_BYTES_PER_S / 2**30:.0f} GiB/s and {HOST_ADAM_ELEMENTS_PER_S / 1e9:.1f} G elements/s)")


def _count(elements: int) -> str:
    """``1.38 M`` / ``5.04 G``: element counts at a readable scale."""
    return f"{elements / 1e9:.2f} G" if elements >= 1e9 else f"{elements / 1e6:.2f} M"


def step_traffic(*, chunk_numel: int, param_bytes_per_element: int, streamed_shards: int, owned_streamed: int,
                 host_updated_resident: int, host_updated: int, gathers_per_step: float) -> StepTraffic:
    """The traffic of one placement.

    Args:
        chunk_numel, param_bytes_per_element: one chunk.
        streamed_shards: this rank's shards at home on the host (each copied in ``gathers_per_step`` times).
        owned_streamed: chunks this rank updates whose shard is at home on the host (their gradients go there).
        host_updated_resident: chunks this rank updates on the host whose shard stays on the device (their
            gradients go out to a staging buffer and their params come back in).
        host_updated: every chunk this rank updates on the host or from NVMe.
        gathers_per_step: times a streamed group is brought onto the device per step.
    """
    chunk_bytes = chunk_numel * param_bytes_per_element
    return StepTraffic(
        h2d_bytes=int((streamed_shards * gathers_per_step + host_updated_resident) * chunk_bytes),
        d2h_bytes=(owned_streamed + host_updated_resident) * chunk_bytes,
        host_adam_elements=host_updated * chunk_numel)
