"""Training telemetry: throughput, model TFLOPS, memory per tier, and the CSV / TensorBoard sinks."""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from zero_cache import format_bytes

logger = logging.getLogger(__name__)


def _nvml_used_bytes(device: torch.device) -> int | None:
    """Device memory in use by every process, as the driver sees it (includes the caching allocator's slack)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # no driver, no NVML, or a sandbox that hides it: report without it
        return None


def memory_snapshot(device: torch.device) -> dict[str, int]:
    """Bytes in each memory tier now, and the device's peak since the last reset.

    Returns:
        ``host_rss``, and on CUDA ``device_allocated``, ``device_peak``, ``device_reserved`` and
        (when NVML answers) ``device_used_nvml``.
    """
    snapshot = {"host_rss": psutil.Process().memory_info().rss}
    if device.type == "cuda":
        snapshot["device_allocated"] = torch.cuda.memory_allocated(device)
        snapshot["device_peak"] = torch.cuda.max_memory_allocated(device)
        snapshot["device_reserved"] = torch.cuda.memory_reserved(device)
        used = _nvml_used_bytes(device)
        if used is not None:
            snapshot["device_used_nvml"] = used
    return snapshot


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def format_memory(snapshot: dict[str, int]) -> str:
    """``device 1.20 GiB (peak 2.00 GiB) | host 0.80 GiB`` (device part only on accelerators)."""
    parts = []
    if "device_allocated" in snapshot:
        parts.append(f"device {_gib(snapshot['device_allocated'])} (peak {_gib(snapshot['device_peak'])})")
    parts.append(f"host {_gib(snapshot['host_rss'])}")
    return " | ".join(parts)


def format_tiers(report: dict[str, float]) -> str:
    """`` | zero-cache device 1.20 GiB, host 3.40 GiB[, nvme 9.00 GiB], moved d2h 0.50 GiB h2d 0.50 GiB[, disk read
    4.00 GiB write 4.00 GiB], overlap 87%``, or ""."""
    if not report:
        return ""
    size = {k: format_bytes(v) for k, v in report.items() if k.endswith("_bytes")}
    text = f" | zero-cache device {size['zero_cache_device_bytes']}, host {size['zero_cache_host_bytes']}"
    if "zero_cache_nvme_bytes" in size:
        text += f", nvme {size['zero_cache_nvme_bytes']}"
    text += f", moved d2h {size['zero_cache_d2h_bytes']} h2d {size['zero_cache_h2d_bytes']}"
    if "zero_cache_nvme_read_bytes" in size:
        text += f", disk read {size['zero_cache_nvme_read_bytes']} write {size['zero_cache_nvme_write_bytes']}"
    if "zero_cache_overlap" in report:
        text += f", overlap {100 * report['zero_cache_overlap']:.0f}%"
    return text


class ThroughputMeter:
    """Tokens/s and model TFLOPS over the interval since the last :meth:`lap`.

    Model FLOPs per token follow the benchmark protocol, (6N + 12 L H S) (PaLM, appendix B);
    recomputation is not counted, so activation checkpointing does not inflate the figure.

    Args:
        flops_per_token: model FLOPs per trained token (forward + backward), or None if unknown.
        device: synchronised before reading the clock, so queued GPU work is counted.
    """

    def __init__(self, flops_per_token: float | None, device: torch.device) -> None:
        self.flops_per_token = flops_per_token
        self.device = device
        self._start = time.perf_counter()
        self._tokens = 0

    def add_tokens(self, num_tokens: int) -> None:
        self._tokens += num_tokens

    def lap(self) -> dict[str, float]:
        """Rates since the previous lap; resets the interval."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # only at log intervals, never per step
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        tokens_per_s = self._tokens / elapsed
        rates = {"tokens_per_s": tokens_per_s, "seconds": elapsed}
        if self.flops_per_token is not None:
            rates["tflops"] = tokens_per_s * self.flops_per_token / 1e12
        self._start, self._tokens = now, 0
        return rates


class MetricsSink:
    """Writes scalar metrics to a CSV file and/or TensorBoard (create it on rank 0 only).

    The CSV is in long form, one ``step,name,value`` row per scalar, so the engine (loss, lr, loss
    scale, grad norm every step) and the training loop (throughput, memory at log intervals) can
    share one file without agreeing on columns.

    Args:
        csv_dir: directory for ``metrics.csv`` (None = off).
        tensorboard_dir: directory for TensorBoard events (None = off).
    """

    def __init__(self, csv_dir: str | None, tensorboard_dir: str | None) -> None:
        self._csv_path = Path(csv_dir) / "metrics.csv" if csv_dir else None
        self._writer = None
        if self._csv_path is not None:
            self._csv_path.parent.mkdir(parents=True, exist_ok=True)
            if not self._csv_path.exists():
                self._csv_path.write_text("step,name,value\n")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(
                    "tensorboard.enabled is true but the tensorboard package is missing: "
                    "pip install 'angelptm[tensorboard]'"
                ) from None
            self._writer = SummaryWriter(log_dir=tensorboard_dir)

    @property
    def enabled(self) -> bool:
        return self._csv_path is not None or self._writer is not None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Record every int/float value in ``metrics`` (others, and None, are skipped)."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._csv_path is not None:
            with open(self._csv_path, "a", newline="") as handle:
                csv.writer(handle).writerows([step, name, value] for name, value in scalars.items())
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(f"Train/{name}", value, step)
            self._writer.flush()
