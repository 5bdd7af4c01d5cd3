"""What the hybrid optimizer reports: per-tier bytes now, and the traffic, waiting and events since the last report.

The optimizer counts into :attr:`OptimizerCounters.counts` and :attr:`OptimizerCounters.timings` as it runs; a report
reads them with the tiers and the copy streams' traffic, then starts them again from zero.
"""

from __future__ import annotations

import collections

import torch

from zero_cache.optim.host_update import HostUpdater
from zero_cache.runtime.transfers import Transfers
from zero_cache.storage.chunks import ChunkStore

COUNTS = ("speculated_chunks", "revised_chunks", "device_stepped_chunks", "clipped_steps", "skipped_steps")
"""Since the last report: chunks updated during backward, of them revised at the step, host chunks stepped on the
device, steps clipped / skipped."""
WAITS = ("grad_wait", "chunk_wait")
"""Seconds the training thread waited for host gradient accumulation / for host chunk updates."""


class OptimizerCounters:
    """The optimizer's counts and waits between reports, and the reports built from them.

    Args:
        store: chunk storage (its tiers, param homes and optimizer-state homes are reported).
        transfers: the copy streams, whose traffic since the last report is taken.
        host: the host worker, whose busy seconds since the last report are taken.
        device: the compute device (the overlap share is reported on CUDA only).
    """

    def __init__(self, store: ChunkStore, transfers: Transfers, host: HostUpdater, device: torch.device) -> None:
        self.store = store
        self.transfers = transfers
        self.host = host
        self.device = device
        self.counts = dict.fromkeys(COUNTS, 0)
        """See :data:`COUNTS`."""
        self.timings = dict.fromkeys(WAITS, 0.0)
        """See :data:`WAITS`."""

    def tier_usage(self) -> dict[str, tuple[int, int]]:
        """Tier name -> (bytes in use, budget bytes), now."""
        return {name: (tier.used_bytes, tier.budget_bytes) for name, tier in self.store.tiers.items()}

    def tier_peaks(self) -> dict[str, int]:
        """Tier name -> the most bytes it has held at once (the warm-up's placement included)."""
        return {name: tier.peak_bytes for name, tier in self.store.tiers.items()}

    def tier_counts(self) -> dict[str, int]:
        """Tier name -> optimizer groups there now (after any re-plan; REMOTE: another rank's)."""
        return dict(collections.Counter(group.tier for group in self.store.groups))

    def param_home_counts(self) -> dict[str, int]:
        """Tier name -> this rank's param shards at home there now (gathered params; empty when resident)."""
        return dict(collections.Counter(self.store.param_home))

    def report(self) -> dict[str, float]:
        """Per-tier bytes and the traffic and waiting since the previous report (then resets those).

        ``overlap`` is the share of the host worker's time (gradient accumulation and CPU Adam)
        that the training thread did not wait for: 1.0 means fully hidden under GPU compute.
        """
        host_work, self.host.busy_s = self.host.busy_s, 0.0
        waited = self.timings["grad_wait"] + self.timings["chunk_wait"]
        report = {f"zero_cache_{name}_bytes": tier.used_bytes for name, tier in self.store.tiers.items()}
        report.update({f"zero_cache_{way}_bytes": moved for way, moved in self.transfers.traffic.take().items()})
        # (optimizer states and param shards at home on the disk: their swap files)
        for home in self.store.all_homes():
            for what, num_bytes in home.disk_report().items():
                key = f"zero_cache_nvme_{what}" if what == "bytes" else f"zero_cache_nvme_{what}_bytes"
                report[key] = report.get(key, 0) + num_bytes
        report.update({f"zero_cache_{name}_s": seconds for name, seconds in self.timings.items()})
        report["zero_cache_host_update_s"] = host_work
        report.update({f"zero_cache_{name}": count for name, count in self.counts.items()})
        self.counts.update(dict.fromkeys(self.counts, 0))
        if host_work > 0 and self.device.type == "cuda":  # on CPU the "device" competes for the same cores
            report["zero_cache_overlap"] = max(0.0, 1.0 - waited / host_work)
        self.timings.update(dict.fromkeys(self.timings, 0.0))
        return report
