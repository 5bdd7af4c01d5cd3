"""AutoPipe's calibration of per-op times to a whole-graph time (pure maths, random inputs)."""

from __future__ import annotations

import random

import pytest

from autopipe.calibration import calibrate_op_times


def reference(raw_s, overhead_s, total_s):
    """Straight from the model: subtract, clamp at 0, then share the total in proportion."""
    net = [t - o if t > o else 0.0 for t, o in zip(raw_s, overhead_s)]
    if sum(net) == 0:
        net = list(raw_s)
    if not total_s or total_s <= 0:
        return net, 1.0
    return [total_s * n / sum(net) for n in net], total_s / sum(net)


@pytest.mark.parametrize("seed", range(20))
def test_calibration_matches_the_reference_on_random_ops(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 300)
    # many small ops near the overhead, a few large ones, some without a backward (0)
    raw = [rng.choice([0.0, rng.uniform(1e-6, 60e-6), rng.uniform(1e-4, 5e-2)]) for _ in range(count)]
    raw[rng.randrange(count)] = rng.uniform(1e-3, 1e-2)  # at least one op above any overhead
    overhead = [rng.choice([5e-6, 25e-6]) for _ in range(count)]
    total = rng.choice([None, 0.0, rng.uniform(1e-3, 1.0)])
    result = calibrate_op_times(raw, overhead, total)
    expected, scale = reference(raw, overhead, total)
    assert result.times_s == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert result.scale == pytest.approx(scale, rel=1e-12)
    if total:
        assert sum(result.times_s) == pytest.approx(total, rel=1e-9)
    # ops at or below their overhead, and ops without a backward, cost nothing after calibration
    assert all(t == 0.0 for t, r, o in zip(result.times_s, raw, overhead) if r <= o)
    # the order of net costs is kept: a larger net op never ends up cheaper
    nets = [max(r - o, 0.0) for r, o in zip(raw, overhead)]
    pairs = sorted(zip(nets, result.times_s))
    assert all(b[1] >= a[1] for a, b in zip(pairs, pairs[1:]))


def test_calibration_falls_back_to_the_raw_times_when_nothing_is_above_the_overhead():
    raw, overhead = [3e-6, 1e-6, 2e-6], [5e-6] * 3
    result = calibrate_op_times(raw, overhead, 12e-6)
    assert result.times_s == pytest.approx([6e-6, 2e-6, 4e-6])
    assert result.scale == pytest.approx(2.0)


def test_calibration_rejects_bad_input():
    with pytest.raises(ValueError, match="overheads"):
        calibrate_op_times([1.0, 2.0], [0.0], 3.0)
    with pytest.raises(ValueError, match=">= 0"):
        calibrate_op_times([1.0, -2.0], [0.0, 0.0], 3.0)
    with pytest.raises(ValueError, match=">= 0"):
        calibrate_op_times([1.0], [-1e-6], 3.0)
