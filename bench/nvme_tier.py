"""NVMe tier bandwidth against raw O_DIRECT ``dd`` on the same disk, same run.

    python bench/nvme_tier.py --path /tmp/nvme-bench --gib 8

For every IO backend that loads here (native csrc AIO, DeepSpeed async_io, python-libaio, the
thread pool) the tier writes ``--gib`` of swap slots through a few reused aligned buffers, the way
the optimizer step does (several slots in flight), then reads them back and checks the bytes.
``dd`` with 1 MiB O_DIRECT blocks is the anchor: ratios are tier / dd.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from zero_cache import AioConfig  # noqa: E402
from zero_cache.storage.nvme import ALIGN_BYTES, NvmeTier  # noqa: E402


def dd_gbps(path: Path, num_bytes: int) -> tuple[float, float]:
    """(write, read) GB/s of dd with 1 MiB O_DIRECT blocks."""
    count = num_bytes // 2**20
    rates = []
    for args in (["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"], [f"if={path}", "of=/dev/null",
                                                                                 "iflag=direct"]):
        start = time.perf_counter()
        proc = subprocess.run(["dd", "bs=1M", f"count={count}", *args], capture_output=True, text=True, check=True)
        seconds = time.perf_counter() - start
        match = re.search(r"(\d+) bytes", proc.stderr)
        rates.append(int(match.group(1)) / seconds / 1e9)
    path.unlink()
    return rates[0], rates[1]


def aligned(num_bytes: int, pin: bool) -> torch.Tensor:
    raw = torch.empty(num_bytes + ALIGN_BYTES, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % ALIGN_BYTES
    return raw[start:start + num_bytes]


def tier_gbps(directory: Path, backend: str, num_bytes: int, slot_bytes: int, buffers: int,
              aio: dict) -> tuple[float, float]:
    tier = NvmeTier(directory, slot_bytes, num_bytes + slot_bytes, AioConfig(backend=backend, **aio))
    try:
        pin = torch.cuda.is_available()
        pool = [aligned(tier.slot_bytes, pin) for _ in range(buffers)]
        for index, buffer in enumerate(pool):
            buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8))
        offsets = [tier.allocate_slot() for _ in range(num_bytes // tier.slot_bytes)]
        rates = []
        for write in (True, False):
            pending: list = [None] * buffers
            start = time.perf_counter()
            for index, offset in enumerate(offsets):
                if pending[index % buffers] is not None:
                    pending[index % buffers].wait()
                call = tier.write if write else tier.read
                pending[index % buffers] = call(offset, pool[index % buffers])
            for request in pending:
                if request is not None:
                    request.wait()
            tier.flush()
            rates.append(len(offsets) * tier.slot_bytes / (time.perf_counter() - start) / 1e9)
        # Each buffer now holds the last slot it read; every slot was written from buffer index % buffers.
        expected = [aligned(tier.slot_bytes, False) for _ in range(buffers)]
        for index, buffer in enumerate(pool):
            tier.read(offsets[index], expected[index]).wait()
            assert torch.equal(expected[index], buffer), "read-back differs from what was written"
        return rates[0], rates[1]
    finally:
        tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default="/tmp/nvme-bench", help="directory on the disk under test")
    parser.add_argument("--gib", type=float, default=8.0, help="bytes written and read per measurement")
    parser.add_argument("--slot-mib", type=int, default=256, help="swap slot size (one optimizer group)")
    parser.add_argument("--buffers", type=int, default=3, help="bounce buffers in flight (the tier uses 3)")
    parser.add_argument("--backends", nargs="+", default=["native", "deepspeed", "libaio", "threads"])
    parser.add_argument("--block-size", type=int, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--thread-count", type=int, default=4)
    args = parser.parse_args()
    directory = Path(args.path)
    directory.mkdir(parents=True, exist_ok=True)
    num_bytes = int(args.gib * 2**30) // (args.slot_mib << 20) * (args.slot_mib << 20)
    aio = {"block_size": args.block_size, "queue_depth": args.queue_depth, "thread_count": args.thread_count}
    dd_write, dd_read = dd_gbps(directory / "dd.bin", num_bytes)
    print(f"dd O_DIRECT 1 MiB: write {dd_write:.2f} GB/s, read {dd_read:.2f} GB/s ({num_bytes / 2**30:.1f} GiB)")
    rows = [("dd (anchor)", dd_write, dd_read)]
    for backend in args.backends:
        try:
            write, read = tier_gbps(directory, backend, num_bytes, args.slot_mib << 20, args.buffers, aio)
        except Exception as err:  # a backend that cannot load here is reported, not fatal
            print(f"{backend}: unavailable ({type(err).__name__}: {str(err).splitlines()[0][:160]})")
            continue
        rows.append((backend, write, read))
    print(f"\naio {aio}, {args.buffers} buffers of {args.slot_mib} MiB\n"
          "| backend | write GB/s | vs dd | read GB/s | vs dd |\n|---|---|---|---|---|")
    for name, write, read in rows:
        print(f"| {name} | {write:.2f} | {write / dd_write:.2f}x | {read:.2f} | {read / dd_read:.2f}x |")


if __name__ == "__main__":
    main()
