"""What the checkpoint manifest's checksum costs: hash throughput, and a save with and without it.

    python bench/checkpoint_hash.py [--gib 2] [--dir /path/on/the/checkpoint/disk]

Prints the single-core throughput of the standard library's checksums, then the time of
``torch.save`` + fsync of ``--gib`` GiB of fp32 tensors written plainly (torch's default, which CRCs each
zip record on one thread), through ``angelptm.checkpoints.manifest.write_hashed``'s path without any
checksum (neither the zip's nor ours), and through it (the manifest's CRC-32 in threads beside the write,
each range handed to the disk at once), alternating, best of ``--repeats``. The issue's bound: the
checksum adds under 5% to the save time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import types
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from angelptm.checkpoints import manifest as checkpoint_manifest  # noqa: E402
from angelptm.checkpoints.manifest import write_hashed  # noqa: E402


def hash_throughput(num_bytes: int) -> dict[str, float]:
    data = os.urandom(num_bytes)
    checks = {"crc32 (zlib)": lambda: zlib.crc32(data), "adler32 (zlib)": lambda: zlib.adler32(data),
              "sha256": lambda: hashlib.sha256(data).digest(), "blake2b": lambda: hashlib.blake2b(data).digest(),
              "sha1": lambda: hashlib.sha1(data).digest()}
    rates = {}
    for name, check in checks.items():
        start = time.perf_counter()
        check()
        rates[name] = num_bytes / (time.perf_counter() - start) / 1e9
    return rates


def plain_save(obj: dict, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def without_crc(obj: dict, path: Path) -> None:
    """``write_hashed``'s write path (threads, early writeback) with the CRC replaced by a constant: what the
    checksum itself costs is the difference to ``write_hashed``."""
    real = checkpoint_manifest.zlib
    checkpoint_manifest.zlib = types.SimpleNamespace(crc32=lambda data, crc=0: 0)
    try:
        write_hashed(obj, path)
    finally:
        checkpoint_manifest.zlib = real


def timed(fn, obj: dict, path: Path) -> float:
    start = time.perf_counter()
    fn(obj, path)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="checkpoint size to write")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name, rate in hash_throughput(512 << 20).items():
        print(f"{name:>15}: {rate:5.2f} GB/s (one core)")
    numel = int(args.gib * 2**30 / 4)
    tensors = {f"t{i}": torch.randn(numel // 16) for i in range(16)}  # 16 tensors, like a sharded state dict
    size_gb = sum(t.numel() * 4 for t in tensors.values()) / 1e9
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = Path(directory) / "states.pt"
        runs: dict[str, list[float]] = {"plain torch.save": [], "write path without CRC": [], "with CRC-32": []}
        for _ in range(args.repeats):  # alternating, so a slow spell of the disk hits every variant
            for (name, times), fn in zip(runs.items(), (plain_save, without_crc, write_hashed)):
                times.append(timed(fn, tensors, path))
    best = {name: min(times) for name, times in runs.items()}
    plain = best["plain torch.save"]
    for name, seconds in best.items():
        print(f"save {size_gb:.2f} GB + fsync, {name:>22}: {seconds:6.2f} s ({size_gb / seconds:.2f} GB/s, "
              f"{100 * (seconds / plain - 1):+.1f}% vs plain)")


if __name__ == "__main__":
    main()
