"""The all-to-all cost model against a brute-force reference (every message of every rank counted one by one)
on random links, the relative-error link fit, and issue 41's logged 2 x 2 gloo run fed to fit and model."""

from __future__ import annotations

import random

import pytest

from moe.topology import (
    Link,
    crossover_bytes,
    crossover_under_noise,
    fit_link,
    flat_all_to_all_s,
    hierarchical_all_to_all_s,
    measured_crossover_bytes,
)

MiB = 2 ** 20


def random_link(rng: random.Random) -> Link:
    return Link(latency_s=rng.uniform(1e-6, 5e-4), bandwidth_bytes_per_s=rng.uniform(1e9, 5e11),
                call_s=rng.uniform(1e-6, 3e-4))


def brute_step_s(link: Link, sizes_bytes: list[float]) -> float:
    """One call over ``link``: its fixed cost, then each message's latency and bytes, one by one."""
    seconds = link.call_s
    for size in sizes_bytes:
        seconds += link.latency_s + size / link.bandwidth_bytes_per_s
    return seconds


def brute_flat_s(b: float, lpn: int, nodes: int, intra: Link, inter: Link, step_s: float) -> float:
    """Rank 0 sends B / W to each rank; on-node and off-node messages go at once, each over its own link."""
    world = lpn * nodes
    on = [b / world for dest in range(1, world) if dest // lpn == 0]
    off = [b / world for dest in range(world) if dest // lpn != 0]
    return step_s + max(brute_step_s(intra, on) if on else 0.0, brute_step_s(inter, off) if off else 0.0)


def brute_hier_s(b: float, lpn: int, nodes: int, intra: Link, inter: Link, step_s: float) -> float:
    """Step 1: rank 0 hands each other local rank the B / L bound for its index on every node; step 2: B / M to
    each other node."""
    seconds = 0.0
    if lpn > 1:
        seconds += step_s + brute_step_s(intra, [sum(b / (lpn * nodes) for _ in range(nodes)) for _ in range(1, lpn)])
    if nodes > 1:
        seconds += step_s + brute_step_s(inter, [sum(b / (lpn * nodes) for _ in range(lpn)) for _ in range(1, nodes)])
    return seconds


def test_formulas_match_brute_force_on_random_links():
    rng = random.Random(41)
    for _ in range(200):
        intra, inter, step_s = random_link(rng), random_link(rng), rng.uniform(0, 3e-4)
        lpn, nodes, b = rng.randint(1, 8), rng.randint(1, 16), 10 ** rng.uniform(3, 9)  # (one node, one per node)
        args = (b, lpn, nodes, intra, inter)
        assert flat_all_to_all_s(*args, step_s=step_s) == pytest.approx(brute_flat_s(*args, step_s))
        assert hierarchical_all_to_all_s(*args, step_s=step_s) == pytest.approx(brute_hier_s(*args, step_s))


def test_crossover_matches_a_scan_of_the_brute_force_reference():
    rng = random.Random(7)
    checked = 0
    while checked < 30:
        intra, inter, step_s = random_link(rng), random_link(rng), rng.uniform(0, 1e-4)
        lpn, nodes = rng.randint(2, 8), rng.randint(2, 16)
        cross = crossover_bytes(lpn, nodes, intra, inter, step_s=step_s)
        ref = (lpn, nodes, intra, inter, step_s)
        wins_at_1 = brute_hier_s(1.0, *ref) < brute_flat_s(1.0, *ref)
        assert (cross is None) == (not wins_at_1)
        if cross is None or cross > 1e11:
            continue
        # Scan a log grid: the brute force says hierarchical wins below the crossover and loses above it.
        for b in (10 ** (k / 8) for k in range(0, 96)):
            if abs(b / cross - 1) > 1e-6:
                assert (brute_hier_s(b, *ref) < brute_flat_s(b, *ref)) == (b < cross), (b, cross)
        checked += 1


def test_fit_link_recovers_random_links_from_two_fanouts_and_one():
    rng = random.Random(3)
    sizes = [2 ** p for p in range(16, 29, 2)]
    for _ in range(20):
        link = random_link(rng)
        points = [(peers, s * peers / (peers + 1), brute_step_s(link, [s / (peers + 1)] * peers))
                  for peers in (1, 2) for s in sizes]
        got = fit_link(points)
        assert got.latency_s == pytest.approx(link.latency_s, rel=1e-6)
        assert got.call_s == pytest.approx(link.call_s, rel=1e-6)
        assert got.bandwidth_bytes_per_s == pytest.approx(link.bandwidth_bytes_per_s, rel=1e-6)
        one = fit_link([p for p in points if p[0] == 1])  # one fan-out: the fixed part is all per-message
        assert one.latency_s == pytest.approx(link.latency_s + link.call_s, rel=1e-6)


# ---- issue 41: bench/results/2026-11-27-4xh200-moe-alltoall-2x2-gloo-f29c9cf.log ----
# (4x H200, 2 nodes x 2, inter link gloo/TCP)
# Probe sizes (MiB per rank) and times (us) of the log's two fits; each probe is an all-to-all over 2 ranks
# (1 peer), moving half its bytes off-rank.
PROBE_MIB = [0.0625, 0.25, 1, 4, 16, 64, 256]
INTRA_US = [63.9, 69.2, 66.2, 67.1, 112.9, 191.0, 539.6]  # NCCL inside a node
INTER_US = [334.7, 419.7, 846.2, 1437.7, 4496.5, 19311.6, 78832.2]  # gloo over TCP through pinned host memory
# (bytes per rank MiB, flat ms, hierarchical ms) of the log's exchange table.
EXCHANGES = [(0.047, 0.624, 0.749), (0.238, 0.638, 0.724), (0.988, 1.151, 1.094), (3.988, 1.941, 1.967),
             (15.988, 4.597, 4.643), (63.988, 18.733, 19.274), (255.988, 79.972, 92.236)]
LOGGED_PREDICTED_MIB, LOGGED_MEASURED_MIB = 36.589, 2.993


def logged_links() -> tuple[Link, Link]:
    intra = fit_link([(1, m * MiB / 2, t * 1e-6) for m, t in zip(PROBE_MIB, INTRA_US)])
    inter = fit_link([(1, m * MiB / 2, t * 1e-6) for m, t in zip(PROBE_MIB, INTER_US)])
    return intra, inter


def logged_exchanges() -> list[tuple[float, float, float]]:
    return [(m * MiB, f * 1e-3, h * 1e-3) for m, f, h in EXCHANGES]


def test_logged_measured_crossover_is_the_logs():
    # The table is rounded to 3 digits.
    assert measured_crossover_bytes(logged_exchanges()) / MiB == pytest.approx(LOGGED_MEASURED_MIB, rel=1e-2)


def test_relative_fit_reproduces_the_logged_slow_link_probes():
    """The log's absolute least squares put the slow link's latency at 136 us where its 64 KiB probe took 335 us
    (59% under); the relative fit stays within 25% of every probe, and 5% of the smallest."""
    _, inter = logged_links()
    for m, t in zip(PROBE_MIB, INTER_US):
        predicted = inter.latency_s + m * MiB / 2 / inter.bandwidth_bytes_per_s
        assert predicted == pytest.approx(t * 1e-6, rel=0.25)
    assert inter.latency_s == pytest.approx(INTER_US[0] * 1e-6, rel=0.05)


def test_logged_crossover_is_too_noisy_for_a_20_percent_target():
    """hier / flat stays within 0.95..1.03 from 1 to 64 MiB, so moving one hierarchical time by 2% moves the
    measured crossover by far more than 20% (or removes it): the 2 x 2 log cannot pin it to 20%."""
    moved = crossover_under_noise(logged_exchanges(), 0.02)
    spread = [m / MiB / LOGGED_MEASURED_MIB for m in moved if m is not None]
    assert max(spread) > 2.0 and (min(spread) < 0.8 or len(spread) < len(moved))


def test_logged_small_sizes_show_the_missing_step_cost():
    """With the logged probes alone (one fan-out per link, no step probe) the model gets flat's small sizes right
    (within 15%) but not hierarchical's: 0.42 against 0.75 ms at 47 KiB. What it misses is the second exchange
    step (~0.17 ms more at 47 KiB than the NCCL and gloo probes add up to)."""
    intra, inter = logged_links()
    b, flat_ms, hier_ms = EXCHANGES[0]
    assert flat_all_to_all_s(b * MiB, 2, 2, intra, inter) * 1e3 == pytest.approx(flat_ms, rel=0.15)
    assert hierarchical_all_to_all_s(b * MiB, 2, 2, intra, inter) * 1e3 < 0.6 * hier_ms


@pytest.mark.xfail(strict=True, reason="issue 41: from the 2 x 2 gloo log the model cannot predict the measured "
                   "crossover within 20%: the log lacks the fan-out and step probes (the bench now takes them), and "
                   "the measured crossover moves > 2x under 2% timing noise (test above)")
def test_logged_crossover_within_20_percent():
    intra, inter = logged_links()
    predicted = crossover_bytes(2, 2, intra, inter)
    assert predicted is not None
    assert predicted / (LOGGED_MEASURED_MIB * MiB) == pytest.approx(1.0, abs=0.2)
