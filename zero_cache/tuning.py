"""The device-step count chosen by measured step times, not by the cost model alone (pure logic).

The planner's floor (:mod:`zero_cache.plan.step_cost`) treats every stream as overlapping compute. Device steps
do not quite: they start after backward (only then is the global norm known) and the next forward needs
their chunks first, so their copies overlap the forward alone, and how long that is depends on the model
(an fp32 head, biases and LayerNorms, recompute) and on the machine (its PCIe and its host's Adam). Seen on
the H100 with a GPT written from ``torch.nn`` modules: 7 device-stepped groups made the step 40% slower than
the floor, and 13B on the H200 ran 28% slower with the plan's count than with none.

So with ``zero_cache.device_steps: "auto"`` the runtime tries a few counts around the plan's, each for a few
steps of real training (the placement stays: only which host groups are stepped on the device changes, see
:func:`zero_cache.plan.planner.with_device_step_count`), and keeps the fastest. Each trial's first step settles
(it pays for the switch) and is not counted; the mean of the next ones stands for the count. Not their fastest:
a step can leave work to the next one (the host's updates and the device steps' copies run on into the next
forward), so one step may look fast while the next pays. At 4.4B on the H100 the fastest of two steps had 9 groups
at 0.98 s, and the steps run with 9 groups after the tuning took 1.32 s (median).

The user should not feel it (issue 37: at 10B on the H100 the first ~21 steps swung between 1.1 and 6.4 s while
five counts were tried for four steps each). So at most :data:`MAX_TRIALS` counts are tried, chosen as the
measurements come (:func:`next_count`: the plan's, half of it, then on in the direction that was faster), which
settles within ``MAX_TRIALS * (SETTLE_STEPS + MEASURED_STEPS)`` steps of the warm-up; and a count whose measured
step runs :data:`SLOW_FACTOR` times the best mean so far is dropped after that one step.

What this does not bound: a count whose work does not fit the step leaves work to the next step, more each step
(13B on the H200 with the plan's 7 groups: 1.45, 2.06, 3.23 s, where 2 groups settle at 1.43 s), and a switch does not
cancel that work: the step after it pays. Ending such a trial after its first grown step was tried (a measured step
1.3x the fastest of the tuning) and measured: the 3.2 s step moved from the trial's last step to the next count's
first, as slow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SETTLE_STEPS = 1
"""Steps after a switch that are not measured (they pay for the switch)."""
MEASURED_STEPS = 2
"""Steps measured per count (their mean stands for it)."""
MAX_TRIALS = 3
"""Counts tried at most."""
SLOW_FACTOR = 1.5
"""A count whose measured step takes this many times the best mean so far is not measured further."""


def next_count(planned: int, most: int, measured: dict[int, float]) -> int | None:
    """The count to try after those ``measured`` (count -> mean step seconds, in the order tried), or None when
    the tuning is done: the plan's count, then half of it (a plan of none: a third of the host groups), then a
    step further the way that was faster: down to a quarter, or up to a third more than the plan's."""
    tried = list(measured)
    if len(tried) >= MAX_TRIALS or most <= 0 and tried:
        return None
    if not tried:
        return planned
    if len(tried) == 1:
        following = round(planned / 2) if planned else max(1, round(most / 3))
    else:
        first, second = tried[0], tried[1]
        lower = measured[second] < measured[first]
        if planned:
            following = round(planned / 4) if lower else min(most, round(4 * planned / 3))
        else:
            following = min(most, 2 * second) if lower else None
    return following if following is not None and following not in measured else None


@dataclass(slots=True)
class DeviceStepTuner:
    """Tries counts as measured step times come in (:func:`next_count`), then settles on the fastest.

    Args:
        planned: the plan's device-step count (in force when the tuner starts).
        most: host groups there are to step.
    """

    planned: int
    most: int
    measured: dict[int, float] = field(init=False, default_factory=dict)
    """Count -> the mean of its measured steps, seconds, in the order tried."""
    backward: dict[int, float] = field(init=False, default_factory=dict)
    """Count -> the mean backward of its measured steps, seconds, where they were timed."""
    current: int = field(init=False)
    """The count in force."""
    done: bool = field(init=False, default=False)
    _steps: list[float] = field(init=False, default_factory=list)
    _backwards: list[float] = field(init=False, default_factory=list)
    _seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not 0 <= self.planned <= max(0, self.most):
            raise ValueError(f"planned device steps {self.planned} must lie in 0..{self.most}")
        self.current = self.planned

    @property
    def counts(self) -> list[int]:
        """The counts tried so far, in order (the one in force last)."""
        return list(dict.fromkeys([*self.measured, self.current]))

    @property
    def best(self) -> int:
        """The fastest count measured so far (the plan's before any measurement); the fewest among equals."""
        if not self.measured:
            return self.planned
        return min(self.measured, key=lambda count: (self.measured[count], count))

    def observe(self, step_seconds: float, backward_seconds: float | None = None) -> int | None:
        """One step's measured time (and its backward's) under :attr:`current`; returns the count to switch to now,
        or None to stay."""
        if self.done:
            return None
        self._seen += 1
        if self._seen <= SETTLE_STEPS:
            return None
        others = [seconds for count, seconds in self.measured.items() if count != self.current]
        self._steps.append(step_seconds)
        if backward_seconds is not None:
            self._backwards.append(backward_seconds)
        self.measured[self.current] = sum(self._steps) / len(self._steps)
        if self._backwards:
            self.backward[self.current] = sum(self._backwards) / len(self._backwards)
        too_slow = bool(others) and step_seconds > SLOW_FACTOR * min(others)
        if self._seen < SETTLE_STEPS + MEASURED_STEPS and not too_slow:
            return None
        self._seen, self._steps, self._backwards = 0, [], []
        following = next_count(self.planned, self.most, self.measured)
        previous = self.current
        if following is None:
            self.done = True
            following = self.best
        self.current = following
        return following if following != previous else None

    def summary(self) -> str:
        """``5 groups (7: 0.604 s, 5: 0.545 s, ...)``: the choice, then each count tried with its mean step."""
        tried = ", ".join(f"{count}: {seconds:.3f} s" for count, seconds in self.measured.items())
        return f"{self.best} groups ({tried})"
