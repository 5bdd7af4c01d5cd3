"""What a placement costs one step besides compute: PCIe bytes each way and CPU Adam (pure arithmetic).

The planner compares placements by this estimate. Transfers in both directions and the host's
Adam run on their own streams and thread beside the GPU's compute, so each is a floor under the
step time and the step is bound by the largest of them (or by compute, which no placement
changes). The rates are :class:`Rates`: until the machine has been measured, an H200's as
DESIGN.md records them (:data:`NOMINAL_RATES`: pinned copies 51 GiB/s each way, DeepSpeedCPUAdam 4.3 G
params/s on 16 cores); after the warm-up step, this machine's (:mod:`zero_cache.runtime.rates`). Their ratio decides
the placement: on the H200 a chunk's CPU Adam costs about six one-way copies of its bf16 params, so a
device byte is worth more as a resident param shard than as an eighth of an optimizer group
only while the shard's copies stay cheaper than that; on an H100's host the Adam ran at 2.9 G/s.

A host-held optimizer group can also be stepped on the device (:mod:`zero_cache.optim.device_steps`): its
states cross PCIe both ways instead of costing CPU Adam, so while the copies have room the host's
share of the step shrinks; :func:`cheapest_device_steps` picks how many by the same floor.

Once the step runs, :meth:`StepTraffic.predicted_step` puts the measured backward in front of the work the next
forward waits on after it, which the engine logs against the measured step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

from zero_cache.plan.units import format_bytes

NUM_STATE_FIELDS = 3
"""An optimizer group's states per element: the master, exp_avg and exp_avg_sq, all in the group's state dtype."""


def state_bytes_per_element(state_itemsize: int) -> int:
    """What an optimizer group holds per element (a gradient's bytes come on top, by its dtype), and what one stepped
    on the device moves each way: 12 bytes in fp32, 6 in bf16 (``bf16_master_weights_and_grads`` with
    ``bf16_optimizer_states``)."""
    return NUM_STATE_FIELDS * state_itemsize


STATE_BYTES_PER_ELEMENT = state_bytes_per_element(4)
"""The fp32 states' bytes per element (the default state dtype)."""


def host_adam_bytes_per_element(param_bytes_per_element: int, state_bytes: int = STATE_BYTES_PER_ELEMENT) -> int:
    """Host memory the host's Adam reads and writes per element: the master and moments (``state_bytes``) both ways,
    the gradient in and the param out in the compute dtype (28 bytes in bf16 with fp32 states, 16 with bf16 states).
    Left out, as a floor: an fp32 accumulator's 2 more, a lazy step's fold and kept gradient (4 more)."""
    return 2 * state_bytes + 2 * param_bytes_per_element


@dataclass(frozen=True, slots=True)
class Rates:
    """How fast each of the step's streams moves its work."""

    h2d_bytes_per_s: float
    """Pinned host -> device copies."""
    d2h_bytes_per_s: float
    """Pinned device -> host copies."""
    host_adam_elements_per_s: float
    """CPU Adam over fp32 masters and moments (with its reads and writes of the chunk's gradient and params)."""
    disk_bytes_per_s: float = 1.0e9
    """The swap files' disk, reads and writes together (DESIGN.md: reads 0.9-1.3, writes 1.6-2.2 GB/s through
    O_DIRECT on an H200's machine)."""
    copies_measured: bool = False
    """The bus measured on this machine (else the nominal copy rates)."""
    host_adam_measured: bool = False
    """The host's Adam timed over this machine's training steps (else the nominal rate: the copy probe does not
    time it)."""
    disk_measured: bool = False
    """The disk's rate measured on this machine's swap directory (:func:`zero_cache.runtime.rates.measured_disk`)."""
    device_step_elements_per_s: float = 0.0
    """Host-held groups stepped on the device, from when they may start (backward and the device-held groups' Adam
    done) to their last copy out, timed over training steps (:func:`zero_cache.runtime.rates.with_timed_work`); 0
    until then, when their copies are priced as running beside everything else at the bus's rates."""

    device_adam_elements_per_s: float = 0.0
    """The device's Adam over the groups it holds (one pass over the master, moments, gradient and params), timed
    where it runs over training steps (:func:`zero_cache.runtime.rates.with_timed_work`); 0 until then, when
    it is not counted (a whole-GPU plan's floor was 0 s, its step 0.338 s)."""
    host_memory_bytes_per_s: float = 0.0
    """The host's memory, read and written together by the host's Adam and the copies beside it, by a probe
    (:func:`zero_cache.runtime.rates.host_memory_rate`); 0 until then, when it is not counted. The host's Adam and
    every copy and disk transfer go through it, so it bounds their sum: only the step's prediction uses it
    (:attr:`StepTraffic.host_memory_bytes`)."""

    def describe(self) -> str:
        copies = "measured here" if self.copies_measured else "nominal: an H200's, until this machine is measured"
        adam = "measured here" if self.host_adam_measured else "nominal: an H200 host's, until training steps time it"
        on_device = (f", device steps {self.device_step_elements_per_s / 1e9:.2f} G elements/s (measured here)"
                     if self.device_step_elements_per_s else "")
        on_device += (f", device Adam {self.device_adam_elements_per_s / 1e9:.1f} G elements/s (measured here)"
                      if self.device_adam_elements_per_s else "")
        on_device += (f", host memory {self.host_memory_bytes_per_s / 1e9:.0f} GB/s (measured here)"
                      if self.host_memory_bytes_per_s else "")
        return (f"H2D {self.h2d_bytes_per_s / 2**30:.0f} GiB/s, D2H {self.d2h_bytes_per_s / 2**30:.0f} GiB/s "
                f"({copies}), host Adam {self.host_adam_elements_per_s / 1e9:.1f} G elements/s ({adam}){on_device}")


def agreed_rates(ranks: Sequence[Rates]) -> Rates:
    """One set of rates for every data-parallel rank: each rate the median of the ranks' (the lower middle one for
    an even count), measured only where every rank measured it.

    Each rank probes its own bus, and a probe can read one rank low: at 49B on 4 H200s of one host one rank read
    H2D 35 GiB/s where the others read about 50, and planned another placement. The ranks of a job run on the same
    kind of machine, so the middle reading stands for all of them, and every rank prices its plan alike.
    """
    if not ranks:
        raise ValueError("agreed_rates needs the rates of at least one rank")

    agreed = {}
    for name in (field.name for field in fields(Rates)):
        values = [getattr(rates, name) for rates in ranks]
        agreed[name] = all(values) if isinstance(values[0], bool) else sorted(values)[(len(values) - 1) // 2]
    return Rates(**agreed)


NOMINAL_RATES = Rates(h2d_bytes_per_s=51 * 2**30, d2h_bytes_per_s=51 * 2**30, host_adam_elements_per_s=4.3e9)
"""An H200's, measured there (DESIGN.md): what a plan assumes before this machine is measured."""


@dataclass(frozen=True, slots=True)
class StepTraffic:
    """Bytes one step moves between host and device, and elements its host updates."""

    h2d_bytes: int = 0
    """Streamed shards copied in on use, and updated params of host-updated chunks copied back in."""
    d2h_bytes: int = 0
    """Gradients of host-updated chunks, to their staging buffer or their shard's home."""
    host_adam_elements: int = 0
    """Elements of the chunks whose optimizer group is on the host or NVMe, less those stepped on the device."""
    device_stepped: int = 0
    """Host-held optimizer groups whose states are copied to the device and stepped there (after backward)."""
    device_step_elements: int = 0
    """Elements of those groups."""
    rates: Rates = NOMINAL_RATES
    """What the floors are worked out at."""
    disk_bytes: int = 0
    """Disk bytes read and written: param shards at home on NVMe (``zero_cache.storage.param_homes.nvme.NvmeHome``: a
    read per gather, a write per update, and a write and a read per gradient that waits for its update on disk,
    :attr:`gradients_to_disk`) and the states of the optimizer groups on NVMe, read and written back once each: a
    floor. Gathers are Belady's rule's estimate over the warm-up's trace (``gathers_per_step``), which the runtime
    can miss by a few (CPU, 82 chunks: 145 gathers where the plan counts 146). Not counted: on a step after a clipped
    one, the kept chunks' gradients wait for the step too (more of them on disk); on a step that clips or skips, a
    second read of each NVMe group whose update in backward was deferred; a tied chunk's second update in backward;
    a re-plan's moves."""
    gradients_to_disk: int = 0
    """Gradients of chunks at home on NVMe that wait for their update after backward beyond what the homes' staging
    buffers hold, so on disk (counted in :attr:`disk_bytes`)."""
    gather_bytes: int = 0
    """Of :attr:`h2d_bytes`: the streamed shards' copies in, on use in forward and backward. The rest comes in after
    the updates (new params, and the device steps' states)."""
    speculated_elements: int = 0
    """Of :attr:`host_adam_elements`: those the host may update during backward, when the step is predicted not to
    clip (chunks that keep their gradient, :mod:`zero_cache.optim.revision`); the others wait for the global norm."""
    device_step_d2h_bytes: int = 0
    """Of :attr:`d2h_bytes`: the device steps' states (and params to a home on the host) going out after their
    update. The rest are gradients, going out during backward."""
    device_adam_elements: int = 0
    """Elements of the optimizer groups held on the device, which the device's Adam updates after backward (before
    the next forward uses their params)."""
    host_adam_bytes: int = host_adam_bytes_per_element(2)
    """Host memory the host's Adam moves per element (:func:`host_adam_bytes_per_element`, by the compute dtype)."""

    @property
    def host_memory_bytes(self) -> int:
        """Bytes the step moves through the host's memory: the host's Adam (:attr:`host_adam_bytes` an element), and
        every copy each way and disk transfer, which land in or leave pinned host memory. A device step moves its
        states through it too (their copies both ways): a group stepped on the device saves the host's cores, but
        little of its memory's traffic (in bf16, a group whose params stay on the device: 24 bytes an element of
        copies, against the host path's 28 and its gradient out and params in)."""
        return self.host_adam_elements * self.host_adam_bytes + self.h2d_bytes + self.d2h_bytes + self.disk_bytes

    def whole_step_floors(self) -> dict[str, float]:
        """:attr:`floors`, named for the whole step, and the host's memory over it once it is measured: what a step
        cannot go under whatever runs when (the step's prediction; the plan's choices take :attr:`floors`)."""
        floors = {f"{stream} (whole step)": seconds for stream, seconds in self.floors.items()}
        if self.rates.host_memory_bytes_per_s:
            floors["host memory (whole step)"] = self.host_memory_bytes / self.rates.host_memory_bytes_per_s
        return floors

    @property
    def floors(self) -> dict[str, float]:
        """Seconds each stream needs for this traffic: "H2D", "D2H", "host Adam", and "disk" when there is any."""
        rates = self.rates
        floors = {"H2D": self.h2d_bytes / rates.h2d_bytes_per_s, "D2H": self.d2h_bytes / rates.d2h_bytes_per_s,
                  "host Adam": self.host_adam_elements / rates.host_adam_elements_per_s}
        if self.disk_bytes:
            floors["disk"] = self.disk_bytes / rates.disk_bytes_per_s
        return floors

    @property
    def seconds(self) -> float:
        """The floor this traffic puts under the step: its slowest stream."""
        return max(self.floors.values())

    @property
    def bound(self) -> str:
        """The stream whose floor is :attr:`seconds`."""
        floors = self.floors
        return max(floors, key=floors.__getitem__)

    def after_backward_floors(self, backward_seconds: float = 0.0, *,
                              updates_after_backward: bool = True) -> dict[str, float]:
        """Seconds of the work between backward and the next forward's use of the chunks: "host Adam" (what the host
        has left to update: every host-updated chunk where the updates wait for the global norm; else those that do
        not keep their gradient, and what of the others' updates during ``backward_seconds`` did not fit), "H2D" (new
        params and the device steps' states in), "D2H" (the device steps' states out), "device steps" at their
        measured rate once it is known (13B on the H200: their copies in and out ran one after the other, not side
        by side as the H2D and D2H floors allow; they follow the device's Adam), and "device Adam" over the device's own
        groups at its measured rate once that is known. Each chunk's update, on the host or stepped on the device, comes
        before the next forward can use it."""
        rates = self.rates
        host = self.host_adam_elements / rates.host_adam_elements_per_s
        if not updates_after_backward:
            during = self.speculated_elements / rates.host_adam_elements_per_s
            host -= min(during, backward_seconds)
        after = {"host Adam": host, "H2D": (self.h2d_bytes - self.gather_bytes) / rates.h2d_bytes_per_s,
                 "D2H": self.device_step_d2h_bytes / rates.d2h_bytes_per_s}
        device_adam = (self.device_adam_elements / rates.device_adam_elements_per_s
                       if rates.device_adam_elements_per_s and self.device_adam_elements else 0.0)
        if rates.device_step_elements_per_s and self.device_step_elements:
            # (timed as they ran: their copies both ways, their Adam, and whatever the bus carried beside them; from
            # when they may start, after the device's own Adam, which their stream waits for)
            after["device steps"] = device_adam + self.device_step_elements / rates.device_step_elements_per_s
        if device_adam:
            after["device Adam"] = device_adam
        return after

    def predicted_step(self, backward_seconds: float, *, updates_after_backward: bool) -> tuple[float, str]:
        """The least step time this traffic allows once backward is measured, and what bounds it.

        The step is its backward, then the slowest of :meth:`after_backward_floors`, which the next forward waits
        on (its own compute hides in it unless it is longer), and never less than a stream's whole-step traffic
        (:meth:`whole_step_floors`: with the host's memory moving :attr:`host_memory_bytes`, once measured). Where the
        updates wait for the global norm (the step clips, or the last one did), the host's Adam starts after backward;
        otherwise the chunks that keep their gradient are updated during it. The forward's compute is not counted: the
        prediction is a floor.

        The host's memory: at 2.7B under a 22 GB cap on an H100 the tuning measured 0.657, 0.665 and 0.663 s at 4, 2
        and 5 groups stepped on the device, where this prediction (without it) was 0.491 s at 4.
        What the counts hardly change is the host's memory traffic: 70-73 GB a step at each, 105-110 GB/s over the
        step. 10B on the whole H100, the same machine, gave 112-114 GB/s at the two fastest of its three counts.
        On an H200's host the probe read 152 GB/s where ``bench/host_memory.py``'s longer mix read 136 and the 2.7B
        capped steps moved 105 (69-71 GB in 0.64-0.67 s, bound by the host's Adam): a floor there, not the bound. Not
        the plan's choices yet (:attr:`floors`): the H100's host, where the steps suggest it binds, has not run it.
        """
        floors = {"backward": backward_seconds, **self.whole_step_floors()}
        after = self.after_backward_floors(backward_seconds, updates_after_backward=updates_after_backward)
        slowest = max(after, key=after.__getitem__)
        if after[slowest] > 0:
            floors[f"backward, then {slowest} after it"] = backward_seconds + after[slowest]
        bound = max(floors, key=floors.__getitem__)
        return floors[bound], bound

    def describe(self) -> str:
        stepped = f", {self.device_stepped} host groups stepped on the device" if self.device_stepped else ""
        stepped += f", disk {format_bytes(self.disk_bytes)}" if self.disk_bytes else ""
        return (f"H2D {format_bytes(self.h2d_bytes)}, D2H {format_bytes(self.d2h_bytes)}, host Adam over "
                f"{_count(self.host_adam_elements)} elements{stepped} (at least {self.seconds:.3f} s at "
                f"{self.rates.describe()}"
                + (f", disk {self.rates.disk_bytes_per_s / 1e9:.1f} GB/s "
                   f"({'measured here' if self.rates.disk_measured else 'nominal'}))" if self.disk_bytes else ")"))


def _count(elements: int) -> str:
    """``1.38 M`` / ``5.04 G``: element counts at a readable scale."""
    return f"{elements / 1e9:.2f} G" if elements >= 1e9 else f"{elements / 1e6:.2f} M"


def step_traffic(*, chunk_numel: int, param_bytes_per_element: int, streamed_shards: int, owned_streamed: int,
                 host_updated_resident: int, host_updated: int, gathers_per_step: float,
                 rates: Rates = NOMINAL_RATES, device_updated: int = 0,
                 state_bytes: int = STATE_BYTES_PER_ELEMENT) -> StepTraffic:
    """The traffic of one placement.

    Args:
        chunk_numel, param_bytes_per_element: one chunk.
        streamed_shards: this rank's shards at home on the host (each copied in ``gathers_per_step`` times).
        owned_streamed: chunks this rank updates whose shard is at home on the host (their gradients go there).
        host_updated_resident: chunks this rank updates on the host whose shard stays on the device (their
            gradients go out to a staging buffer and their params come back in).
        host_updated: every chunk this rank updates on the host or from NVMe.
        gathers_per_step: times a streamed group is brought onto the device per step.
        rates: what its floors are worked out at.
        device_updated: chunks this rank updates on the device from groups held there.
        state_bytes: an optimizer group's bytes per element (:func:`state_bytes_per_element`).
    """
    chunk_bytes = chunk_numel * param_bytes_per_element
    gathers = int(streamed_shards * gathers_per_step * chunk_bytes)
    return StepTraffic(
        h2d_bytes=gathers + host_updated_resident * chunk_bytes, gather_bytes=gathers,
        d2h_bytes=(owned_streamed + host_updated_resident) * chunk_bytes,
        host_adam_elements=host_updated * chunk_numel, rates=rates, device_adam_elements=device_updated * chunk_numel,
        host_adam_bytes=host_adam_bytes_per_element(param_bytes_per_element, state_bytes))


@dataclass(frozen=True, slots=True)
class HostChunk:
    """What a host-updated chunk moves for its update, by where its params and gradients live."""

    params_home_on_host: bool
    """Its shard lives in pinned host memory (streamed params): the host updates it in place."""
    accumulating: bool
    """Its gradient is an fp32 accumulator on the host (micro-batches accumulate)."""


def with_device_steps(traffic: StepTraffic, stepped: Sequence[HostChunk], *, chunk_numel: int,
                      param_bytes_per_element: int, state_bytes: int = STATE_BYTES_PER_ELEMENT) -> StepTraffic:
    """``traffic`` with the chunks ``stepped`` updated on the device instead of by the host's Adam.

    Such a chunk's states cross PCIe both ways (``state_bytes`` per element each way: 12 in fp32), and its gradient
    comes in when it is on the host (the accumulator, or the shard's home); its new params go out to a home on
    the host, or are written on the device, where the host path would have sent its gradient out and its
    params back in.
    """
    h2d = d2h = out = 0
    for chunk in stepped:
        grad_in = (state_bytes // NUM_STATE_FIELDS if chunk.accumulating
                   else param_bytes_per_element if chunk.params_home_on_host else 0)
        if chunk.params_home_on_host:  # the host would update it in place; from the device its params go home
            h2d += state_bytes + grad_in
            d2h += state_bytes + param_bytes_per_element
            out += state_bytes + param_bytes_per_element
        else:  # the host would take its gradient out and send its params back; the device writes them in place
            h2d += state_bytes + grad_in - param_bytes_per_element
            d2h += state_bytes - param_bytes_per_element
            out += state_bytes
    return replace(traffic, h2d_bytes=traffic.h2d_bytes + h2d * chunk_numel,
                   d2h_bytes=traffic.d2h_bytes + d2h * chunk_numel,
                   device_step_d2h_bytes=traffic.device_step_d2h_bytes + out * chunk_numel,
                   host_adam_elements=traffic.host_adam_elements - len(stepped) * chunk_numel,
                   device_stepped=traffic.device_stepped + len(stepped),
                   device_step_elements=traffic.device_step_elements + len(stepped) * chunk_numel)


def cheapest_device_steps(traffic: StepTraffic, candidates: Sequence[HostChunk], *, chunk_numel: int,
                          param_bytes_per_element: int, state_bytes: int = STATE_BYTES_PER_ELEMENT,
                          most: int | None = None) -> int:
    """How many of ``candidates`` (host-updated chunks, the next forward's first first) to step on the device:
    the count with the lowest floor, the fewest among equals; a configured count ``most`` is taken as it is
    (within the candidates)."""
    if most is not None:
        return min(most, len(candidates))
    floors = [with_device_steps(traffic, candidates[:count], chunk_numel=chunk_numel,
                                param_bytes_per_element=param_bytes_per_element, state_bytes=state_bytes).seconds
              for count in range(len(candidates) + 1)]
    return min(range(len(floors)), key=lambda count: (floors[count], count))
