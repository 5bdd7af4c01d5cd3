"""The host's memory as the step uses it: the re-plan's probe against the host's Adam and the bus's copies, alone
and at once.

    python3 bench/host_memory.py --numel 300000000 --repeats 8

The step's prediction counts the bytes a step moves through the host's memory (``StepTraffic.host_memory_bytes``:
the host's Adam at 28 bytes an element, every copy byte each way) at the rate of a probe the re-plan runs
(``zero_cache.runtime.rates.host_memory_rate``: the host's Adam over a 1 GiB scratch chunk beside pinned copies both
ways). That is right only if the probe reads what the host's Adam and the copies get together over a step. This
measures, on one machine, in one run:

1. the probe, as the engine runs it (on a GPU after the bus's probe, as the re-plan does);
2. the host's Adam alone (the csrc kernel over one chunk of bf16 gradients, ``--repeats`` steps, each after the
   gradient lands in its buffer), in G elements/s and in GB/s at 32 bytes an element (the Adam's 28 and the
   landing copy's 4);
3. on a GPU, pinned copies alone, both ways at once on two streams;
4. on a GPU, both at once: the copies queued to outlast the Adam, and counted up to the Adam's end.

Prints one JSON line (GB are 1e9 bytes): ``probe_gbs``, ``adam_alone`` and ``adam_mixed`` (G elements/s),
``copies_alone_gbs`` and ``copies_mixed_gbs`` (both ways together), ``mixed_total_gbs`` (the Adam's bytes and the
copies' during the same seconds), ``mixed_over_probe``, and ``copies_ran_out`` (true where the queued copies ended
before the Adam did: the mixed figures of the copies are then left out; run again with a larger ``--copy-margin``).
In the matrix's reading of 2026-11-28 (`59a6305`) the H100's steps moved 105-114 GB/s at their fastest device-step
counts. On an H200's host (2026-11-29) the first probe, one host buffer copied onto another, read 53 GB/s against
a mixed 133: the reason the probe is now the Adam beside copies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zero_cache.optim.host_adam import HostAdam  # noqa: E402
from zero_cache.plan.step_cost import host_adam_bytes_per_element  # noqa: E402
from zero_cache.runtime.rates import copy_load, host_memory_rate, measured_copies, measured_host_memory  # noqa: E402
from zero_cache.storage.tiers import Tier  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
COPY_BYTES = 1 << 30
"""Bytes of each pinned copy buffer (one each way)."""
COPIES_ALONE_S = 0.5
"""Seconds of copies each way, at the bus's measured rates, that time the copies alone."""
LOOP_BYTES = host_adam_bytes_per_element(2) + 4
"""Host memory per element of one timed Adam step: the Adam's, and the bf16 gradient copied into its buffer."""


def adam_steps(adam: HostAdam, tensors: tuple[torch.Tensor, ...], repeats: int) -> float:
    """Seconds for ``repeats`` steps of the host's Adam over one chunk (its bf16 gradient rewritten each time, as it
    lands from the device)."""
    master, grad_and_param, exp_avg, exp_avg_sq, grad = tensors
    start = time.perf_counter()
    for step in range(1, repeats + 1):
        grad_and_param.copy_(grad)
        adam.update_in_place(master, grad_and_param, exp_avg, exp_avg_sq, step=step, grad_scale=1.0, **HYPER)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=300_000_000, help="elements of the host's Adam chunk")
    parser.add_argument("--repeats", type=int, default=8, help="Adam steps per timing")
    parser.add_argument("--copy-margin", type=float, default=2.0,
                        help="copies queued for the mixed run, over those the Adam's time alone would take")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    host = Tier("host", torch.device("cpu"), 4 * COPY_BYTES, pin_memory=cuda)  # (the copies' 2, the probe's)
    adam = HostAdam(True, try_deepspeed=False, try_native=True)
    if not adam.fuses(torch.bfloat16):
        raise SystemExit("the csrc host Adam did not build here; it is what the step runs")
    result: dict[str, float | int | str | bool] = {"numel": args.numel, "adam_threads": adam.threads}
    work = adam.probe_work(torch.bfloat16)
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # (as the re-plan probes it: the bus, then the host's memory beside copies at the bus's rates)
        known = measured_copies(device, host)
        probed = measured_host_memory(device, host, work, known).host_memory_bytes_per_s
    else:
        probed = host_memory_rate(host, work) or 0.0  # (the Adam's alone: no copies)
    if not probed:  # (its warning says why)
        raise SystemExit("the host memory probe gave no figure")
    result["probe_gbs"] = probed / 1e9
    n = args.numel
    tensors = (torch.randn(n), torch.empty(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n),
               (torch.randn(n) * 1e-3).bfloat16())
    adam_steps(adam, tensors, 1)  # (first touches of the pages)
    alone = adam_steps(adam, tensors, args.repeats)
    result["adam_alone"] = n * args.repeats / alone / 1e9
    result["adam_alone_gbs"] = result["adam_alone"] * LOOP_BYTES

    if cuda:
        with copy_load(device, host, known, nbytes=COPY_BYTES) as bus:  # (the probe's copies, in 1 GiB pieces)
            first = bus.mark()
            bus.queue(COPIES_ALONE_S)
            copied = bus.moved_between(first)  # (every one: they ran alone until the last)
            seconds = max(first.elapsed_time(ends[-1]) for ends in bus.ends.values()) / 1e3
            result["copies_alone_gbs"] = copied / seconds / 1e9
            # Copies to outlast the Adam at the bus's rates alone, then the Adam on this thread meanwhile.
            bus.queue(alone * args.copy_margin)
            first = bus.mark()
            mixed = adam_steps(adam, tensors, args.repeats)
            last = bus.mark()
            outlasted, copied = bus.outlasted(first, last), bus.moved_between(first, last)
        result["copies_ran_out"] = not outlasted
        result["adam_mixed"] = n * args.repeats / mixed / 1e9
        if outlasted:
            result["copies_mixed_gbs"] = copied / mixed / 1e9
            result["mixed_total_gbs"] = result["adam_mixed"] * LOOP_BYTES + result["copies_mixed_gbs"]
            result["mixed_over_probe"] = result["mixed_total_gbs"] / result["probe_gbs"]
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps({key: round(value, 3) if isinstance(value, float) else value for key, value in result.items()}))


if __name__ == "__main__":
    main()
