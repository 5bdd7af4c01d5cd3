"""What a step is predicted to cost once its backward is measured (zero_cache.plan.step_cost), against arithmetic
written out here per stream."""

from __future__ import annotations

import dataclasses
import random

import pytest

from zero_cache.plan.step_cost import (
    STATE_BYTES_PER_ELEMENT,
    HostChunk,
    Rates,
    host_adam_bytes_per_element,
    step_traffic,
    with_device_steps,
)


def random_rates() -> Rates:
    return Rates(h2d_bytes_per_s=random.uniform(10, 60) * 2**30, d2h_bytes_per_s=random.uniform(10, 60) * 2**30,
                 host_adam_elements_per_s=random.uniform(0.5, 6) * 1e9)


def random_traffic():
    """A random placement's traffic with some host groups stepped on the device, and the numbers it was made of."""
    numel, pb = random.choice([1 << 20, 3 << 22, 1 << 25]), random.choice([2, 4])
    streamed = random.randint(0, 6)
    owned_streamed = random.randint(0, streamed)
    resident = random.randint(0, 12)
    gathers = random.uniform(1.0, 3.0)
    rates = random_rates()
    traffic = step_traffic(chunk_numel=numel, param_bytes_per_element=pb, streamed_shards=streamed,
                           owned_streamed=owned_streamed, host_updated_resident=resident,
                           host_updated=owned_streamed + resident, gathers_per_step=gathers, rates=rates)
    # The first chunks the forward needs: those whose shard stays on the device, then those streamed.
    candidates = [HostChunk(params_home_on_host=False, accumulating=False)] * resident + \
        [HostChunk(params_home_on_host=True, accumulating=False)] * owned_streamed
    stepped = random.randint(0, len(candidates))
    stepped_resident = min(stepped, resident)
    stepped_streamed = stepped - stepped_resident
    traffic = with_device_steps(traffic, candidates[:stepped], chunk_numel=numel, param_bytes_per_element=pb)
    kept = random.randint(0, resident + owned_streamed - stepped)  # (those updated in backward, unless it clips)
    traffic = dataclasses.replace(traffic, speculated_elements=kept * numel)
    return traffic, dict(kept=kept, numel=numel, pb=pb, streamed=streamed, gathers=gathers, resident=resident,
                         owned_streamed=owned_streamed, stepped_resident=stepped_resident,
                         stepped_streamed=stepped_streamed, rates=rates)


def test_the_work_after_a_clipped_backward_is_the_updates_and_their_copies_not_the_gathers_or_gradients():
    for _ in range(300):
        traffic, n = random_traffic()
        numel, pb, rates = n["numel"], n["pb"], n["rates"]
        host_elements = (n["resident"] + n["owned_streamed"] - n["stepped_resident"] - n["stepped_streamed"]) * numel
        # In after the norm: params of the resident chunks the host updates; states (and, for a streamed shard, its
        # gradient from its home) of those stepped on the device. Out: the stepped ones' states (and params home).
        h2d_after = ((n["resident"] - n["stepped_resident"]) * pb + n["stepped_resident"] * STATE_BYTES_PER_ELEMENT
                     + n["stepped_streamed"] * (STATE_BYTES_PER_ELEMENT + pb)) * numel
        d2h_after = (n["stepped_resident"] * STATE_BYTES_PER_ELEMENT
                     + n["stepped_streamed"] * (STATE_BYTES_PER_ELEMENT + pb)) * numel
        after = traffic.after_backward_floors()
        assert after["host Adam"] == pytest.approx(host_elements / rates.host_adam_elements_per_s)
        assert after["H2D"] == pytest.approx(h2d_after / rates.h2d_bytes_per_s)
        assert after["D2H"] == pytest.approx(d2h_after / rates.d2h_bytes_per_s)
        # The gathers come in during forward and backward, the gradients go out during backward: whole-step streams.
        gathers = int(n["streamed"] * n["gathers"] * numel * pb)
        assert traffic.h2d_bytes == gathers + h2d_after
        assert traffic.gather_bytes == gathers


def test_a_clipped_step_is_predicted_as_its_backward_then_the_slowest_work_after_it():
    for _ in range(300):
        traffic, _ = random_traffic()
        backward = random.uniform(0.05, 2.0)
        predicted, bound = traffic.predicted_step(backward, updates_after_backward=True)
        after = traffic.after_backward_floors()
        slowest = max(after, key=after.get)
        assert predicted == pytest.approx(max(backward + after[slowest], traffic.seconds))
        if after[slowest] == 0:  # nothing waits for the norm
            assert bound == ("backward" if backward >= traffic.seconds else f"{traffic.bound} (whole step)")
        elif backward + after[slowest] >= traffic.seconds:
            assert bound == f"backward, then {slowest} after it"
        else:
            assert bound == f"{traffic.bound} (whole step)"


def test_updating_in_backward_leaves_after_it_what_did_not_fit_in_it_and_the_chunks_that_keep_no_gradient():
    for _ in range(300):
        traffic, n = random_traffic()
        rates = n["rates"]
        backward = random.uniform(0.01, 1.0)
        kept_seconds = n["kept"] * n["numel"] / rates.host_adam_elements_per_s
        other_seconds = traffic.host_adam_elements / rates.host_adam_elements_per_s - kept_seconds
        host_after = max(0.0, kept_seconds - backward) + other_seconds
        after = traffic.after_backward_floors(backward, updates_after_backward=False)
        assert after["host Adam"] == pytest.approx(host_after, abs=1e-12)
        assert {k: v for k, v in after.items() if k != "host Adam"} == \
            {k: v for k, v in traffic.after_backward_floors().items() if k != "host Adam"}
        predicted, _ = traffic.predicted_step(backward, updates_after_backward=False)
        assert predicted == pytest.approx(max(backward + max(after.values()), traffic.seconds))
        # Waiting for the norm never makes a step cheaper.
        assert traffic.predicted_step(backward, updates_after_backward=True)[0] >= predicted - 1e-12


def test_device_steps_at_their_measured_rate_follow_backward_and_price_nothing_else():
    """Once the tuning has timed the device steps (13B on the H200: their copies in and out ran one after the
    other), the work after backward counts them at that rate, and nothing else moves: no other stream, no
    whole-step floor (the plan's choices stay on the bus's rates)."""
    for _ in range(300):
        traffic, n = random_traffic()
        stepped = n["stepped_resident"] + n["stepped_streamed"]
        rate = random.uniform(0.5, 8) * 1e9
        timed = dataclasses.replace(traffic, rates=dataclasses.replace(n["rates"], device_step_elements_per_s=rate))
        assert timed.device_step_elements == stepped * n["numel"]
        backward = random.uniform(0.05, 2.0)
        device_steps = stepped * n["numel"] / rate
        for after_backward in (True, False):
            after = timed.after_backward_floors(backward, updates_after_backward=after_backward)
            untimed = traffic.after_backward_floors(backward, updates_after_backward=after_backward)
            if stepped:
                assert after.pop("device steps") == pytest.approx(device_steps)
            assert after == untimed
            predicted, bound = timed.predicted_step(backward, updates_after_backward=after_backward)
            was, _ = traffic.predicted_step(backward, updates_after_backward=after_backward)
            assert predicted == pytest.approx(max(was, backward + device_steps if stepped else 0.0))
            if stepped and backward + device_steps > was:
                assert bound == "backward, then device steps after it"
        assert timed.seconds == traffic.seconds and timed.floors == traffic.floors
        assert "device steps" in timed.rates.describe() and "device steps" not in traffic.rates.describe()


def test_the_devices_adam_at_its_measured_rate_follows_backward_and_prices_nothing_else():
    """A whole-GPU plan has no host traffic, so its floor was 0 s (its step 0.338 s on an H100). Once the device's
    own Adam is timed, the work after backward counts it, and a plan of device groups alone is predicted as its
    backward, then that Adam."""
    for _ in range(300):
        traffic, n = random_traffic()
        groups = random.randint(0, 12)
        rate = random.uniform(5, 200) * 1e9
        untimed = dataclasses.replace(traffic, device_adam_elements=groups * n["numel"])
        timed = dataclasses.replace(untimed, rates=dataclasses.replace(n["rates"], device_adam_elements_per_s=rate))
        backward = random.uniform(0.05, 2.0)
        for after_backward in (True, False):
            after = timed.after_backward_floors(backward, updates_after_backward=after_backward)
            if groups:
                assert after.pop("device Adam") == pytest.approx(groups * n["numel"] / rate)
            assert after == untimed.after_backward_floors(backward, updates_after_backward=after_backward)
        assert timed.seconds == untimed.seconds and "device Adam" in timed.rates.describe()
        # Device steps start once the device's Adam is done (their stream waits for it): the two run one after the
        # other.
        stepping = dataclasses.replace(timed.rates, device_step_elements_per_s=random.uniform(0.5, 8) * 1e9)
        both = dataclasses.replace(timed, rates=stepping).after_backward_floors(backward)
        if timed.device_step_elements and groups:
            assert both["device steps"] == pytest.approx(
                groups * n["numel"] / rate + timed.device_step_elements / stepping.device_step_elements_per_s)
        whole_gpu = step_traffic(chunk_numel=n["numel"], param_bytes_per_element=n["pb"], streamed_shards=0,
                                 owned_streamed=0, host_updated_resident=0, host_updated=0, gathers_per_step=1.0,
                                 rates=timed.rates, device_updated=groups)
        assert whole_gpu.seconds == 0 and whole_gpu.device_adam_elements == groups * n["numel"]
        predicted, bound = whole_gpu.predicted_step(backward, updates_after_backward=False)
        assert predicted == pytest.approx(backward + groups * n["numel"] / rate)
        assert bound == ("backward, then device Adam after it" if groups else "backward")


def test_the_host_memory_carries_the_host_adam_and_every_copy_and_is_a_whole_step_floor_of_the_prediction_alone():
    """At 2.7B capped on an H100 the tuning measured 0.657-0.665 s at 2, 4 and 5 device-stepped groups, where the
    prediction without the host's memory was 0.491 s: the counts hardly change the host's memory traffic. Once the
    probe has read the host's memory, the prediction counts it over the whole step; the plan's floors do not."""
    for _ in range(300):
        traffic, n = random_traffic()
        numel, pb = n["numel"], n["pb"]
        stepped = n["stepped_resident"] + n["stepped_streamed"]
        host_elements = (n["resident"] + n["owned_streamed"] - stepped) * numel
        gathers = int(n["streamed"] * n["gathers"] * numel * pb)
        # Each host-updated chunk: the host's Adam (its states both ways, its gradient in and its param out: 28 bytes
        # an element in bf16, 32 in fp32), its gradient out and (resident) its params back in. Each stepped one: its
        # states both ways, and a streamed one's gradient home, back in, and its params out.
        assert host_adam_bytes_per_element(pb) == 24 + 2 * pb == traffic.host_adam_bytes
        adam_bytes = host_elements * (24 + 2 * pb)
        host_path = ((n["resident"] - n["stepped_resident"]) * 2 * pb + n["owned_streamed"] * pb) * numel
        device_path = (n["stepped_resident"] * 2 * STATE_BYTES_PER_ELEMENT
                       + n["stepped_streamed"] * 2 * (STATE_BYTES_PER_ELEMENT + pb)) * numel
        disk = random.choice([0, random.randint(1, 1 << 32)])
        traffic = dataclasses.replace(traffic, disk_bytes=disk)
        assert traffic.host_memory_bytes == adam_bytes + gathers + host_path + device_path + disk
        bandwidth = random.uniform(20, 200) * 1e9
        probed = dataclasses.replace(traffic, rates=dataclasses.replace(n["rates"], host_memory_bytes_per_s=bandwidth))
        assert probed.floors == traffic.floors and probed.seconds == traffic.seconds  # (the plan's choices)
        backward = random.uniform(0.05, 2.0)
        for after_backward in (True, False):
            was, was_bound = traffic.predicted_step(backward, updates_after_backward=after_backward)
            predicted, bound = probed.predicted_step(backward, updates_after_backward=after_backward)
            host_memory = traffic.host_memory_bytes / bandwidth
            assert predicted == pytest.approx(max(was, host_memory))
            assert bound == ("host memory (whole step)" if host_memory > was else was_bound)
        assert "host memory" in probed.rates.describe() and "host memory" not in traffic.rates.describe()
