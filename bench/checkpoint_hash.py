"""What the checkpoint manifest's checksum costs: hash throughput, and a save with and without it.

    python bench/checkpoint_hash.py [--gib 2] [--dir /path/on/the/checkpoint/disk]

Prints the single-core throughput of the standard library's checksums, then the time of
``torch.save`` + fsync of ``--gib`` GiB of fp32 tensors written plainly and through
``angelptm.checkpoint_manifest.write_hashed`` (CRC-32 in a thread beside the write), alternating,
best of ``--repeats``. The issue's bound: the checksum adds under 5% to the save time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from angelptm.checkpoint_manifest import write_hashed  # noqa: E402


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
        plain, hashed = [], []
        for _ in range(args.repeats):
            plain.append(timed(plain_save, tensors, path))
            hashed.append(timed(write_hashed, tensors, path))
    best_plain, best_hashed = min(plain), min(hashed)
    print(f"save {size_gb:.2f} GB + fsync: plain {best_plain:.2f} s ({size_gb / best_plain:.2f} GB/s), with CRC-32 "
          f"{best_hashed:.2f} s ({size_gb / best_hashed:.2f} GB/s): {100 * (best_hashed / best_plain - 1):+.1f}%")


if __name__ == "__main__":
    main()
