"""The device-step count chosen by measured step times, not by the cost model alone (pure logic).

The planner's floor (:mod:`zero_cache.step_cost`) treats every stream as overlapping compute. Device steps
do not quite: they start after backward (only then is the global norm known) and the next forward needs
their chunks first, so their copies overlap the forward alone, and how long that is depends on the model
(an fp32 head, biases and LayerNorms, recompute) and on the machine (its PCIe and its host's Adam). Seen on
the H100 with a GPT written from ``torch.nn`` modules: 7 device-stepped groups made the step 40% slower than
the floor, and 13B on the H200 ran 28% slower with the plan's count than with none.

So with ``zero_cache.device_steps: "auto"`` the runtime tries a few counts around the plan's, each for a few
steps of real training (the placement stays: only which host groups are stepped on the device changes, see
:func:`zero_cache.planner.with_device_step_count`), and keeps the fastest. Each trial's first step settles
(it pays for the switch) and is not counted; the mean of the next ones stands for the count. Not their fastest:
a step can leave work to the next one (the host's updates and the device steps' copies run on into the next
forward), so one step may look fast while the next pays. At 4.4B on the H100 the fastest of two steps had 9 groups
at 0.98 s, and the steps run with 9 groups after the tuning took 1.32 s (median).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SETTLE_STEPS = 1
"""Steps after a switch that are not measured (they pay for the switch: freed and allocated kept gradients)."""
MEASURED_STEPS = 3
"""Steps measured per count (their mean stands for it)."""


def trial_counts(planned: int, most: int) -> list[int]:
    """The counts to try, the plan's first: fractions of the plan's count down to none, and a third more (the
    host's Adam may be slower than the planner's rate); with a plan of none, a third of the host groups."""
    if most <= 0:
        return [0]
    if planned == 0:
        return [0, max(1, round(most / 3))]
    counts = [planned, round(2 * planned / 3), round(planned / 3), 0, min(most, round(4 * planned / 3))]
    return list(dict.fromkeys(counts))


@dataclass(slots=True)
class DeviceStepTuner:
    """Steps through :func:`trial_counts` as measured step times come in, then settles on the fastest.

    Args:
        planned: the plan's device-step count (in force when the tuner starts).
        most: host groups there are to step.
    """

    planned: int
    most: int
    counts: list[int] = field(init=False)
    """The counts to try, in order."""
    measured: dict[int, float] = field(init=False, default_factory=dict)
    """Count -> the mean of its measured steps, seconds."""
    backward: dict[int, float] = field(init=False, default_factory=dict)
    """Count -> the mean backward of its measured steps, seconds, where they were timed."""
    _steps: list[float] = field(init=False, default_factory=list)
    _backwards: list[float] = field(init=False, default_factory=list)
    _trial: int = field(init=False, default=0)
    _seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not 0 <= self.planned <= max(0, self.most):
            raise ValueError(f"planned device steps {self.planned} must lie in 0..{self.most}")
        self.counts = trial_counts(self.planned, self.most)

    @property
    def current(self) -> int:
        """The count in force."""
        return self.counts[self._trial] if not self.done else self.best

    @property
    def done(self) -> bool:
        return self._trial >= len(self.counts)

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
        count = self.counts[self._trial]
        self._steps.append(step_seconds)
        if backward_seconds is not None:
            self._backwards.append(backward_seconds)
        self.measured[count] = sum(self._steps) / len(self._steps)
        if self._backwards:
            self.backward[count] = sum(self._backwards) / len(self._backwards)
        if self._seen < SETTLE_STEPS + MEASURED_STEPS:
            return None
        self._trial, self._seen, self._steps, self._backwards = self._trial + 1, 0, [], []
        following = self.current
        return following if following != count else None

    def summary(self) -> str:
        """``5 groups (7: 0.604 s, 5: 0.545 s, ...)``: the choice, then each count tried with its mean step."""
        tried = ", ".join(f"{count}: {seconds:.3f} s" for count, seconds in self.measured.items())
        return f"{self.best} groups ({tried})"
