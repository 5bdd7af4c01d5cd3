"""From a warm-up trace and tier budgets to a placement plan (pure functions, no tensors).

Per chunk there are two groups of state:

* the **param** chunk in the compute dtype, read by forward and backward;
* the **optimizer group**: fp32 master, exp_avg, exp_avg_sq, and an fp32 gradient accumulator
  when micro-batches accumulate (single-micro-batch gradients are written into the param chunk
  and take no bytes of their own), read and written once per step.

The plan decides, in this order of value per device byte:

1. device room left after the measured non-model peak (activations, workspace) and a margin;
2. param chunks resident on the device for the whole run when they all fit (no traffic at all);
   with *gathered* params (sharded over ranks, or streamed from the host) each collective group's
   shard has a **home** (the device, pinned host memory, or NVMe; what each costs is
   :mod:`zero_cache.plan.home_costs`, the order the homes off the device are filled is its data), and
   ``cache_slots`` groups are live on the device at once, filled along the trace ahead of use and
   emptied by Belady's eviction rule (:mod:`zero_cache.plan.eviction`: evict the group whose next use is furthest
   away; the plan prices it and the runtime runs the same function).
   The live groups and gradient buckets are the **working set** (:mod:`zero_cache.plan.working_set`): where the
   config's does not fit, it shrinks (the spare groups, the lagged bucket, the prefetch depth) before a
   plan is refused, and a plan that keeps the config's has the same counts it always had.
   Which shards stay home on the device is chosen by what the step costs, and where NVMe homes are permitted
   (``offload_param: nvme``), which of the others live in host memory and which on the disk
   (:mod:`zero_cache.plan.step_cost`): a streamed shard costs PCIe bytes every time it is used, a
   device byte given to it is not given to optimizer groups, and a host optimizer group costs
   CPU Adam time and PCIe bytes of its own;
3. as many optimizer groups on the device as fit (updated by the GPU Adam, no traffic), for the
   chunks used first in the forward, so the host's update of the later chunks hides behind it;
4. as many of the rest on the host as its budget holds, plus ``staging_buffers`` pinned param-sized
   buffers through which every host<->device transfer goes;
5. with an NVMe tier, the remaining groups in its swap file: those of the chunks used *last* in the
   forward, whose updates start first in backward and are needed last by the next forward, so
   their disk reads and writes have the most compute to hide under. They cost the host
   ``swap_buffers`` pinned bounce buffers (read chunk i+1 while updating chunk i while writing
   chunk i-1) and, when micro-batches accumulate, their fp32 gradient accumulators (steps 3 to 5 fill the state
   homes in the order of :data:`~zero_cache.plan.state_costs.STATE_FILL_ORDER`);
6. with host memory left, a **kept gradient** (one param chunk's bytes) for as many host-updated
   chunks as it holds, again those used last in the forward: a chunk updated during backward keeps
   its gradient until the step knows the global norm, so the update can be taken back or redone
   exactly (:mod:`zero_cache.optim.revision`). A chunk without one is updated after backward instead (its gradient
   waits in its home: one at home on NVMe, beyond a few buffers, on disk and back, which the step's disk bytes count);
7. of the host groups, those the next forward needs first may be **stepped on the device** after
   backward (their states copied in and back out through the device's update scratch), as many as
   lower the step's floor: the host's Adam is then left fewer groups while PCIe has room
   (:func:`~zero_cache.plan.step_cost.cheapest_device_steps`). They need no kept gradient.

If something does not fit, :func:`make_plan` raises :class:`PlanError` with the shortfall per
tier and what to change, before a single byte is allocated (for the device, against the least working set).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Sequence

from zero_cache.plan.eviction import belady_misses  # noqa: F401  (re-exported: the rule over a trace)
from zero_cache.plan.home_costs import OFF_DEVICE_FILL_ORDER, home_costs
from zero_cache.plan.placement import DEVICE_MARGIN_FRACTION, Plan, PlanError, PlanInputs  # noqa: F401  (re-exported)
from zero_cache.plan.state_costs import STATE_FILL_ORDER, Route, state_costs
from zero_cache.plan.step_cost import HostChunk, StepTraffic, cheapest_device_steps, step_traffic, with_device_steps
from zero_cache.plan.tier_names import DEVICE, HOST, NVME, OFF_DEVICE, REMOTE  # noqa: F401  (re-exported)
from zero_cache.plan.units import AUTO, format_bytes
from zero_cache.plan.working_set import GROUPS_IN_USE, WorkingSet, budget_for_room, live_groups_in, shrinking


def first_use_order(trace: Sequence[int], num_chunks: int) -> tuple[int, ...]:
    """Chunks by first appearance in the trace, then any never traced, in index order."""
    seen: dict[int, None] = dict.fromkeys(trace)
    return tuple(seen) + tuple(c for c in range(num_chunks) if c not in seen)


def make_plan(inputs: PlanInputs) -> Plan:
    """Decide placement; raise PlanError with the shortfall when it cannot fit.

    The wanted working set (live groups, prefetch depth, gradient buckets) is tried first; where no placement
    holds it, ever smaller ones (:func:`~zero_cache.plan.working_set.shrinking`), down to the least that works.

    Returns:
        The plan, maximising device residency in the order described in the module docstring (for
        gathered params, the cheapest placement of the shards by :mod:`zero_cache.plan.step_cost`).
    """
    error: PlanError | None = None
    for working in _working_sets(inputs):
        try:
            return _plan_with(inputs, working)
        except PlanError as err:
            error = err
    raise error


def _working_sets(inputs: PlanInputs) -> list[WorkingSet]:
    """The working sets to try, the wanted one first: with resident params, only the gradient buckets shrink."""
    if inputs.param_chunks_held is None:
        buckets = sorted({inputs.gradient_buckets, min(inputs.gradient_buckets, GROUPS_IN_USE)}, reverse=True)
        return [WorkingSet(ahead=0, live_groups=0, buckets=count) for count in buckets]
    wanted = WorkingSet(ahead=inputs.gather_ahead, live_groups=inputs.live_groups, buckets=inputs.gradient_buckets)
    return list(shrinking(wanted, inputs.param_chunks_held))


def _fixed_device_bytes(inputs: PlanInputs, working: WorkingSet) -> int:
    """Device bytes besides params and optimizer groups: activations, the update scratch and the buckets."""
    return inputs.activation_reserve_bytes + inputs.scratch_bytes + working.buckets * inputs.live_group_bytes


def _plan_with(inputs: PlanInputs, working: WorkingSet) -> Plan:
    """The plan with ``working``'s buckets and prefetch depth; PlanError when nothing fits."""
    room = int(inputs.device_budget_bytes * (1 - inputs.margin_fraction)) - _fixed_device_bytes(inputs, working)
    if inputs.param_chunks_held is not None:
        return _plan_gathered(inputs, room, working)
    all_params = (inputs.num_chunks + inputs.padding_chunks) * inputs.param_chunk_bytes
    if room < all_params:
        need = budget_for_room(all_params + _fixed_device_bytes(inputs, working), inputs.margin_fraction)
        remedy = ("zero_cache.param_home \"auto\" or \"host\" streams them from the host instead"
                  if inputs.group_size == 1 else
                  "zero_cache.shard_params \"auto\" or true gathers them on use instead (and streams this rank's "
                  "shards from the host where they do not fit either)")
        raise PlanError(_shortfall_message(DEVICE, need, inputs.device_budget_bytes, inputs, detail=(
            f"it holds every param chunk ({format_bytes(all_params)}) besides "
            f"{format_bytes(inputs.activation_reserve_bytes)} of activations; {remedy}"), disk_relieves=False))
    owned = _owned_in_use_order(inputs)
    device_optim = min(len(owned), (room - all_params) // inputs.optimizer_chunk_bytes)
    return _finish(inputs, working, resident_bytes=all_params, live=0, device_optim=owned[:device_optim], home=(),
                   host_params_bytes=0, traffic=_traffic(inputs, (), owned, device_optim))


def _owned_in_use_order(inputs: PlanInputs) -> list[int]:
    """This rank's chunks, those the next forward needs first first."""
    mine = set(inputs.owned_chunks)
    return [c for c in first_use_order(inputs.trace, inputs.num_chunks) if c in mine]


def _plan_gathered(inputs: PlanInputs, room: int, working: WorkingSet) -> Plan:
    """Gathered params: how many shards stay home on the device (the groups used first), the live groups,
    and the optimizer groups on the device, by the cheapest step; PlanError when nothing fits."""
    held, shard_bytes = inputs.param_chunks_held, inputs.param_chunk_bytes
    size = inputs.group_size
    groups_in_order = list(dict.fromkeys(c // size for c in first_use_order(inputs.trace, inputs.num_chunks)))
    groups_in_order += [g for g in range(held) if g not in groups_in_order]
    owned = _owned_in_use_order(inputs)
    # "auto" weighs device homes against those off the device it permits; a named home takes every shard.
    resident_options = range(held, -1, -1) if inputs.param_home == AUTO else (
        [0] if home_costs(inputs.param_home).streams else [held])
    best: tuple | None = None
    failure: PlanError | None = None
    for resident in resident_options:
        streamed = held - resident
        cap = held if size > 1 else streamed  # one rank: a shard at home on the device is used in place
        left = room - resident * shard_bytes
        live = live_groups_in(working, left, inputs.live_group_bytes, cap)
        if live is None:
            continue
        left -= live * inputs.live_group_bytes
        home_on_device = set(groups_in_order[:resident])
        eligible = [c for c in owned if c // size in home_on_device]  # device Adam needs the shard on the device
        device_optim = min(len(eligible), left // inputs.optimizer_chunk_bytes)

        def placed(home: tuple[str, ...]) -> Plan | None:
            nonlocal failure
            try:
                return _finish(inputs, working, resident_bytes=resident * shard_bytes, live=live,
                               device_optim=eligible[:device_optim], home=home,
                               host_params_bytes=sum(home_costs(name).host_bytes(home.count(name), shard_bytes)
                                                     for name in set(home)),
                               traffic=_traffic(inputs, home, owned, device_optim, eligible))
            except PlanError as err:
                failure = failure or err
                return None

        for plan in _streamed_placements(inputs, groups_in_order, resident, placed):
            key = (plan.traffic.seconds, -resident, -device_optim, sum(home_costs(h).on_disk for h in plan.param_home))
            if best is None or key < best[0]:
                best = (key, plan)
    if best is not None:
        return best[1]
    if failure is not None:
        raise failure
    raise PlanError(_working_set_shortfall(inputs, working))


def _streamed_placements(inputs: PlanInputs, groups_in_order: list[int], resident: int,
                         placed: Callable[[tuple[str, ...]], Plan | None]) -> Iterator[Plan]:
    """The plans to weigh with the first ``resident`` groups of ``groups_in_order`` at home on the device
    (``placed``: the plan of given homes, None where it does not fit). A named home takes every other shard; "auto"
    puts them on the host, or, where the config permits params on NVMe (DeepSpeed's ``offload_param: nvme``), the
    first of them on the host and the rest on NVMe.

    A shard's host bytes save the disk three times their number a step (two reads and a write), an optimizer
    group's twice theirs: so the most host homes that fit is weighed (found by bisection: each more takes host
    memory), beside all on the host, none and halfway; ``make_plan`` keeps the cheapest.
    """
    on_device = set(groups_in_order[:resident])
    streamed = [g for g in groups_in_order if g not in on_device]
    first, last = _off_device_homes(inputs)

    def homes(on_host: int) -> tuple[str, ...]:
        host = set(streamed[:on_host])  # (the first used: host groups can be stepped on the device)
        return tuple(DEVICE if g in on_device else first if g in host else last
                     for g in range(inputs.param_chunks_held))

    if inputs.param_home != AUTO or last == first or not streamed:
        plan = placed(homes(0))
        if plan is not None:
            yield plan
        return
    tried: dict[int, Plan | None] = {}

    def tried_with(on_host: int) -> Plan | None:
        if on_host not in tried:
            tried[on_host] = placed(homes(on_host))
        return tried[on_host]

    low, high = 0, len(streamed)
    while low < high:  # the most host homes that fit (or none)
        middle = (low + high + 1) // 2
        if tried_with(middle) is not None:
            low = middle
        else:
            high = middle - 1
    for on_host in sorted({len(streamed), low, low // 2, 0}, reverse=True):
        plan = tried_with(on_host)
        if plan is not None:
            yield plan


def _off_device_homes(inputs: PlanInputs) -> tuple[str, str]:
    """(the first, the last) home off the device that the streamed shards fill, in the order of
    :data:`~zero_cache.plan.home_costs.OFF_DEVICE_FILL_ORDER`: "auto" fills the first, then the last the config permits;
    a named home that streams takes them all."""
    first = OFF_DEVICE_FILL_ORDER[0]
    if inputs.param_home == AUTO:
        return first, next((h for h in reversed(OFF_DEVICE_FILL_ORDER) if h in inputs.param_homes_off_device), first)
    return first, inputs.param_home if home_costs(inputs.param_home).streams else first


def _working_set_shortfall(inputs: PlanInputs, working: WorkingSet) -> str:
    """Why the device cannot hold ``working`` (the least working set, when make_plan gets here): its parts in
    bytes, and the budget that would hold them."""
    held, shard_bytes, group_bytes = inputs.param_chunks_held, inputs.param_chunk_bytes, inputs.live_group_bytes
    fewest = 0 if inputs.param_home == AUTO or home_costs(inputs.param_home).streams else held
    cap = held if inputs.group_size > 1 else held - fewest  # as _plan_gathered: one rank uses its own in place
    live = min(working.fewest_live, cap)
    need = budget_for_room(fewest * shard_bytes + live * group_bytes + _fixed_device_bytes(inputs, working),
                           inputs.margin_fraction)
    in_use = min(GROUPS_IN_USE, live)
    return _shortfall_message(DEVICE, need, inputs.device_budget_bytes, inputs, detail=(
        f"the least it can run with holds {fewest} param shards of {format_bytes(shard_bytes)} at home, "
        f"{live} gathered groups of {format_bytes(group_bytes)} ({in_use} in use, {live - in_use} fetched ahead), "
        f"{working.buckets} gradient buckets of {format_bytes(group_bytes)} "
        f"({format_bytes(working.buckets * group_bytes)}), the fp32 update scratch of "
        f"{format_bytes(inputs.scratch_bytes)} and {format_bytes(inputs.activation_reserve_bytes)} of activations, "
        f"with {inputs.margin_fraction:.0%} kept free"), disk_relieves=False)


def _traffic(inputs: PlanInputs, home: tuple[str, ...], owned: list[int], device_optim: int,
             eligible: list[int] | None = None) -> StepTraffic:
    """The step's PCIe bytes and host Adam of a placement (see :mod:`zero_cache.plan.step_cost`)."""
    on_device = set((owned if eligible is None else eligible)[:device_optim])
    streamed = {g for g, where in enumerate(home) if home_costs(where).streams}
    owned_streamed = sum(1 for c in owned if c // inputs.group_size in streamed)
    host_updated = [c for c in owned if c not in on_device]
    traffic = step_traffic(chunk_numel=inputs.chunk_numel, param_bytes_per_element=inputs.param_bytes_per_element,
                           streamed_shards=len(streamed), owned_streamed=owned_streamed,
                           host_updated_resident=len(host_updated) - owned_streamed, host_updated=len(host_updated),
                           gathers_per_step=inputs.gathers_per_step, rates=inputs.rates,
                           device_updated=len(owned) - len(host_updated), state_bytes=inputs.state_bytes_per_element)
    disk = _home_disk_bytes(inputs, home, owned, {})
    return replace(traffic, disk_bytes=disk) if disk else traffic


def _home_disk_bytes(inputs: PlanInputs, home: tuple[str, ...], owned: list[int], waiting: dict[str, int]) -> int:
    """Disk bytes the param homes move per step (:meth:`~zero_cache.plan.home_costs.HomeCosts.disk_bytes_per_step`),
    with ``waiting`` gradients per kind of home waiting for their update after backward."""
    owned_in = {name: sum(1 for c in owned if home[c // inputs.group_size] == name) for name in set(home)}
    return sum(home_costs(name).disk_bytes_per_step(home.count(name), owned_in[name], inputs.param_chunk_bytes,
                                                    inputs.gathers_per_step, waiting.get(name, 0))
               for name in set(home))


def _with_waiting_gradients(inputs: PlanInputs, traffic: StepTraffic, home: tuple[str, ...], owned: list[int],
                            off_device: list[int], kept: tuple[int, ...], stepped: tuple[int, ...]) -> StepTraffic:
    """``traffic`` (its disk bytes the homes' alone, as :func:`_traffic` counts them) with what the gradients cost
    that wait in their homes for an update after backward: those of the host-updated chunks (``off_device``)
    neither kept (updated during backward, :mod:`zero_cache.optim.revision`) nor stepped on the device, with one
    micro-batch per step (accumulated gradients go to the fp32 accumulators, not home). A home may hold only so
    many of them and send the rest to disk and back
    (:meth:`~zero_cache.plan.home_costs.HomeCosts.gradients_to_disk_per_step`).
    Counted for a step after an unclipped one: after a clipped step the kept chunks wait too."""
    if not home or inputs.grad_bytes_per_element:
        return traffic
    updated_early = set(kept) | set(stepped)
    waiting: dict[str, int] = {}
    for chunk in off_device:
        if chunk not in updated_early:
            name = home[chunk // inputs.group_size]
            waiting[name] = waiting.get(name, 0) + 1
    to_disk = sum(home_costs(name).gradients_to_disk_per_step(count) for name, count in waiting.items())
    if not to_disk:
        return traffic
    return replace(traffic, disk_bytes=_home_disk_bytes(inputs, home, owned, waiting), gradients_to_disk=to_disk)


def _finish(inputs: PlanInputs, working: WorkingSet, *, resident_bytes: int, live: int, device_optim: list[int],
            home: tuple[str, ...], host_params_bytes: int, traffic: StepTraffic) -> Plan:
    """The plan, once the device's share is decided: the other owned groups go to the host, then NVMe.

    Device optimizer groups go to the chunks the next forward needs first: the host groups' CPU
    Adam and their host->device copies then overlap the forward through those early layers. Of the
    host groups, the first ones the forward needs are stepped on the device after backward, as many
    as make the step cheapest (:mod:`zero_cache.optim.device_steps`): the host's Adam has the rest.
    """
    owned = _owned_in_use_order(inputs)
    off_device = [c for c in owned if c not in set(device_optim)]
    # A shard at home on the host is its own staging buffer, except while accumulating (it holds the weights the
    # next micro-batch reads, so gradients stage through the pool on their way to the fp32 accumulators).
    staged = bool(off_device) and (inputs.grad_bytes_per_element > 0 or any(
        not home or home_costs(home[c // inputs.group_size]).stages_updates for c in off_device))
    homes_disk = sum(home_costs(name).disk_bytes(home.count(name), inputs.param_chunk_bytes) for name in set(home))
    if homes_disk > inputs.nvme_budget_bytes:
        raise PlanError(_shortfall_message(NVME, homes_disk, inputs.nvme_budget_bytes, inputs, detail=(
            f"the param shards at home there take {format_bytes(homes_disk)} (of "
            f"{format_bytes(inputs.param_chunk_bytes)} each)")))
    num_host, num_nvme, host_bytes = _split_host_and_nvme(inputs, len(off_device),
                                                          inputs.scratch_bytes + host_params_bytes, staged, homes_disk)
    on_host = off_device[:num_host]
    traffic, stepped, kept, host_bytes = _device_steps_and_kept(inputs, traffic, off_device, on_host, home, host_bytes,
                                                                inputs.device_steps)
    traffic = _with_waiting_gradients(inputs, traffic, home, owned, off_device, kept, stepped)
    on_device, off_device_first, last = STATE_FILL_ORDER[0], STATE_FILL_ORDER[1], STATE_FILL_ORDER[-1]
    tiers = [REMOTE] * inputs.num_chunks
    for chunk in device_optim:
        tiers[chunk] = on_device
    for position, chunk in enumerate(off_device):
        tiers[chunk] = off_device_first if position < num_host else last
    traffic = _with_swapped_states(inputs, traffic, tiers)
    device_bytes = (resident_bytes + live * inputs.live_group_bytes + len(device_optim) * inputs.optimizer_chunk_bytes
                    + inputs.scratch_bytes + working.buckets * inputs.live_group_bytes)
    streams = any(home_costs(where).streams for where in home)
    return Plan(params_resident=not streams, cache_slots=live, optimizer_tier=tuple(tiers),
                device_bytes=device_bytes, host_bytes=host_bytes,
                nvme_bytes=num_nvme * inputs.swap_slot_bytes + homes_disk, param_nvme_bytes=homes_disk,
                params_sharded=inputs.param_chunks_held is not None, param_home=home, group_size=inputs.group_size,
                traffic=traffic, kept_gradients=kept, device_stepped=stepped,
                gather_ahead=working.ahead if inputs.param_chunks_held is not None else 0,
                gradient_buckets=working.buckets)


def _device_steps_and_kept(inputs: PlanInputs, traffic: StepTraffic, off_device: list[int], on_host: list[int],
                           home: tuple[str, ...], host_bytes: int, count: int | None
                           ) -> tuple[StepTraffic, tuple[int, ...], tuple[int, ...], int]:
    """Of the host groups ``on_host`` (use order), the first ``count`` stepped on the device (None: the cheapest
    count), and the kept gradients the host has room for among the other ``off_device`` groups, those used last.

    Returns:
        The traffic with those device steps, the device-stepped chunks, the chunks keeping their gradient, and
        the host bytes with the kept gradients.
    """
    homes = [home_costs(home[c // inputs.group_size]) if home else None for c in on_host]
    # (the first chunks the next forward needs, up to one whose home cannot be stepped on the device)
    steppable = next((i for i, kind in enumerate(homes) if kind is not None and not kind.device_steppable), len(homes))
    candidates = [HostChunk(params_home_on_host=kind is not None and kind.in_host_memory,
                            accumulating=inputs.grad_bytes_per_element > 0) for kind in homes[:steppable]]
    sizes = dict(chunk_numel=inputs.chunk_numel, param_bytes_per_element=inputs.param_bytes_per_element,
                 state_bytes=inputs.state_bytes_per_element)
    stepping = cheapest_device_steps(traffic, candidates, most=count, **sizes)
    traffic = with_device_steps(traffic, candidates[:stepping], **sizes)
    keepers = off_device[stepping:]  # a chunk stepped on the device after backward keeps no gradient
    kept_chunk_bytes = inputs.chunk_numel * inputs.kept_bytes_per_element
    num_kept = 0 if not kept_chunk_bytes else max(0, min(len(keepers),
                                                         (inputs.host_budget_bytes - host_bytes) // kept_chunk_bytes))
    kept = tuple(sorted(keepers[len(keepers) - num_kept:]))
    # Updated during backward when the step is predicted not to clip: those keeping their gradient, or, with
    # accumulators on the host, every host-updated chunk.
    speculated = traffic.host_adam_elements if inputs.grad_bytes_per_element > 0 else len(kept) * inputs.chunk_numel
    traffic = replace(traffic, speculated_elements=speculated)
    return traffic, tuple(on_host[:stepping]), kept, host_bytes + num_kept * kept_chunk_bytes


def device_steppable_groups(inputs: PlanInputs, plan: Plan) -> list[int]:
    """The optimizer groups this rank updates that ``plan`` leaves off the device in a home the device may step,
    in use order: those a device-step count chooses among (:func:`with_device_step_count`)."""
    costs = {c: state_costs(plan.optimizer_tier[c]) for c in _owned_in_use_order(inputs)}
    return [c for c, cost in costs.items() if cost.route is not Route.DEVICE_ADAM and cost.device_steppable]


def with_device_step_count(inputs: PlanInputs, plan: Plan, count: int) -> Plan:
    """``plan``'s placement with ``count`` of its host groups (those the next forward needs first) stepped on the
    device, and the kept gradients that leaves room for: what the runtime's measured choice of the count applies
    (:mod:`zero_cache.plan.tuning`) without moving a shard or an optimizer group.

    Args:
        inputs: the inputs ``plan`` was made from.
        plan: the plan in force.
        count: host groups to step on the device (at most the host groups there are).
    """
    owned = _owned_in_use_order(inputs)
    routes = {c: state_costs(plan.optimizer_tier[c]).route for c in owned}
    device_optim = [c for c in owned if routes[c] is Route.DEVICE_ADAM]
    off_device = [c for c in owned if routes[c] is not Route.DEVICE_ADAM]
    on_host = device_steppable_groups(inputs, plan)
    traffic = _traffic(inputs, plan.param_home, owned, len(device_optim), device_optim)
    without_kept = plan.host_bytes - len(plan.kept_gradients) * inputs.chunk_numel * inputs.kept_bytes_per_element
    traffic, stepped, kept, host_bytes = _device_steps_and_kept(inputs, traffic, off_device, on_host, plan.param_home,
                                                                without_kept, min(count, len(on_host)))
    traffic = _with_waiting_gradients(inputs, traffic, plan.param_home, owned, off_device, kept, stepped)
    traffic = _with_swapped_states(inputs, traffic, plan.optimizer_tier)
    return replace(plan, traffic=traffic, device_stepped=stepped, kept_gradients=kept, host_bytes=host_bytes)


def _with_swapped_states(inputs: PlanInputs, traffic: StepTraffic, tiers: Sequence[str]) -> StepTraffic:
    """``traffic`` with the disk reads and writes of the optimizer groups placed in ``tiers`` (one per chunk): each
    step an NVMe group's states are read into a bounce buffer and written back
    (:meth:`~zero_cache.plan.state_costs.StateCosts.disk_bytes_per_step`)."""
    moved = sum(state_costs(name).disk_bytes_per_step(tiers.count(name), inputs.swap_slot_bytes) for name in set(tiers))
    if not moved:
        return traffic
    return replace(traffic, disk_bytes=traffic.disk_bytes + moved)


def _split_host_and_nvme(inputs: PlanInputs, off_device: int, host_fixed: int, staged: bool, nvme_fixed: int = 0
                         ) -> tuple[int, int, int]:
    """(groups on the host, groups on NVMe, host bytes) for the ``off_device`` groups, host first;
    ``staged``: some of their gradients reach the host through the staging buffers; ``nvme_fixed``: disk bytes
    already taken (param shards at home there)."""
    staging = inputs.staging_buffers * inputs.param_chunk_bytes if staged else 0
    per_host = inputs.optimizer_chunk_bytes
    per_nvme_on_host = inputs.chunk_numel * inputs.grad_bytes_per_element  # accumulators stay in RAM
    bounce = inputs.swap_buffers * inputs.swap_buffer_bytes

    def host_bytes(num_host: int) -> int:
        num_nvme = off_device - num_host
        return (host_fixed + staging + num_host * per_host + num_nvme * per_nvme_on_host
                + (bounce if num_nvme else 0))

    if host_bytes(off_device) <= inputs.host_budget_bytes:
        return off_device, 0, host_bytes(off_device)
    if inputs.nvme_budget_bytes - nvme_fixed <= 0:
        raise PlanError(_shortfall_message(HOST, host_bytes(off_device), inputs.host_budget_bytes, inputs, detail=(
            f"{off_device} chunks' optimizer states ({inputs.optimizer_bytes_per_element} B/element)"
            + ("" if host_fixed == inputs.scratch_bytes else " and every param chunk's home copy") + " live there")))
    num_host = max(0, (inputs.host_budget_bytes - host_bytes(0)) // max(1, per_host - per_nvme_on_host))
    num_host = min(num_host, off_device - 1)
    if host_bytes(num_host) > inputs.host_budget_bytes:
        raise PlanError(_shortfall_message(HOST, host_bytes(num_host), inputs.host_budget_bytes, inputs, detail=(
            f"even with {off_device - num_host} optimizer groups on NVMe it holds {inputs.swap_buffers} bounce "
            f"buffers of {format_bytes(inputs.swap_buffer_bytes)}, {inputs.staging_buffers} staging buffers"
            + (" and the gradient accumulators" if per_nvme_on_host else "")
            + ", which the NVMe tier's reads and writes go through: only host memory can hold them"),
            host_buffers=True))
    num_nvme = off_device - num_host
    if num_nvme * inputs.swap_slot_bytes + nvme_fixed > inputs.nvme_budget_bytes:
        beside = f" beside {format_bytes(nvme_fixed)} of param shards at home there" if nvme_fixed else ""
        raise PlanError(_shortfall_message(NVME, num_nvme * inputs.swap_slot_bytes + nvme_fixed,
                                           inputs.nvme_budget_bytes, inputs, detail=f"{num_nvme} optimizer groups of "
                                           f"{format_bytes(inputs.swap_slot_bytes)} go to disk{beside}"))
    return num_host, num_nvme, host_bytes(num_host)


def _shortfall_message(tier: str, need: int, have: int, inputs: PlanInputs, detail: str, *,
                       host_buffers: bool = False, disk_relieves: bool = True) -> str:
    """``host_buffers``: the host is short of the NVMe tier's own buffers, so the one remedy is a larger host budget;
    ``disk_relieves``: more room on disk would let ``tier`` hold less (not so for the device's working set: the disk
    holds optimizer groups and shards, which leave the device first anyway)."""
    total = inputs.num_chunks * (inputs.param_chunk_bytes + inputs.optimizer_chunk_bytes)
    owned = len(inputs.owned_chunks)
    held = inputs.num_chunks if inputs.param_chunks_held is None else inputs.param_chunks_held
    params = "every param chunk" if inputs.param_chunks_held is None else f"{held} param chunks"
    held_bytes = held * inputs.param_chunk_bytes + owned * inputs.optimizer_chunk_bytes
    share = ("" if owned == inputs.num_chunks else
             f" (this data-parallel rank holds {params} and the optimizer states of {owned} of the "
             f"{inputs.num_chunks} chunks: {format_bytes(held_bytes)})")
    head = (f"model states do not fit: the {tier} tier needs {format_bytes(need)} but its budget is "
            f"{format_bytes(have)} (short by {format_bytes(need - have)}); {detail}. All model states together "
            f"take {format_bytes(total)}{share}. ")
    if host_buffers:
        return head + f"Raise zero_cache.{tier}_memory_budget to at least {need} bytes."
    return head + ", ".join([f"Raise zero_cache.{tier}_memory_budget to at least {need} bytes",
                             *_nvme_advice(inputs, need - have, disk_relieves),
                             "shrink the micro-batch or enable activation checkpointing", "or use more GPUs."])


def _nvme_advice(inputs: PlanInputs, short_bytes: int, disk_relieves: bool) -> list[str]:
    """What the disk tier can do about a shortfall: add one; or, with one set, how much more room it needs (an
    "auto" budget is the disk's free space less a margin of at least 1 GiB, so a small disk gives 0 B)."""
    if not (inputs.nvme_path_set or inputs.nvme_budget_bytes):
        return ["add an NVMe tier (zero_cache.nvme_path)"]
    if not disk_relieves:
        return []
    return [f"give the NVMe tier room: it is set, but its disk is too small by at least {format_bytes(short_bytes)} "
            f"(the tier's budget is {format_bytes(inputs.nvme_budget_bytes)}, and an \"auto\" budget leaves at least "
            "1 GiB of the disk free): free disk space under zero_cache.nvme_path, raise zero_cache.nvme_memory_budget "
            "if it was set lower, or point nvme_path at a larger disk"]
