"""The device-step count chosen by measured step times, not by the cost model alone (pure logic).

The planner's floor (:mod:`zero_cache.plan.step_cost`) treats every stream as overlapping compute. Device steps
do not quite: they start after backward (only then is the global norm known) and the next forward needs
their chunks first, so their copies overlap the forward alone, and how long that is depends on the model
(an fp32 head, biases and LayerNorms, recompute) and on the machine (its PCIe and its host's Adam). Seen on
the H100 with a GPT written from ``torch.nn`` modules: 7 device-stepped groups made the step 40% slower than
the floor, and 13B on the H200 ran 28% slower with the plan's count than with none.

So with ``zero_cache.device_steps: "auto"`` the runtime tries a few counts below the plan's, each for a few
steps of real training (the placement stays: only which host groups are stepped on the device changes, see
:func:`zero_cache.plan.planner.with_device_step_count`), and keeps the fastest. Each trial's first step settles
(it pays for the switch) and is not counted; the mean of the next ones stands for the count. Not their fastest:
a step can leave work to the next one (the host's updates and the device steps' copies run on into the next
forward), so one step may look fast while the next pays. At 4.4B on the H100 the fastest of two steps had 9 groups
at 0.98 s, and the steps run with 9 groups after the tuning took 1.32 s (median).

The user should not feel it (issue 37: at 10B on the H100 the first ~21 steps swung between 1.1 and 6.4 s while
five counts were tried for four steps each). So at most :data:`MAX_TRIALS` counts are tried, chosen as the
measurements come (:func:`next_count`: half the plan's, a quarter, then on in the direction that was faster), which
settles within ``MAX_TRIALS * (SETTLE_STEPS + MEASURED_STEPS)`` steps of the warm-up (twice that where the steps'
update timing changes during it: :class:`DeviceStepTuner`); a count whose measured
step runs :data:`SLOW_FACTOR` times the best mean so far is dropped after that one step; and a switch waits for
none of the host's queued work (``ZeroCacheOptimizer.apply_plan``).

Two things made the tuning's slowest steps (13B on the H200, the plan's 7 groups first: 1.45, 2.06, 3.23 s, where
2 groups settle at 1.43 s). The switch waited for the host updates and device steps of the chunks it changed: about
1.2 s of the 3.23. And the plan's count leaves work to the next step, more each step (2.03, 2.55 s once the switch
waited for nothing): its floor prices the device steps' copies as overlapping the whole step, where they overlap
only the next forward, which is why the tuning starts below it. Pricing them right is the floor's to do
(:mod:`zero_cache.plan.step_cost`).

The tuning's measurements compare counts; they are not what the settled step costs. The check of the step
against the plan's prediction is taken over the :data:`CHECK_STEPS` steps after the tuning settles
(:class:`SettledSteps`), and says where the tuning's figure for the count differs from them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

SETTLE_STEPS = 1
"""Steps after a switch that are not measured (they pay for the switch)."""
MEASURED_STEPS = 2
"""Steps measured per count (their mean stands for it)."""
MAX_TRIALS = 3
"""Counts tried at most."""
SLOW_FACTOR = 1.5
"""A count whose measured step takes this many times the best mean so far is not measured further."""
RESTARTS = 1
"""Times the tuning starts over when the steps' update timing changes (see :class:`DeviceStepTuner`)."""
RETUNE_STEPS = 3
"""Steps in a row under another update timing than the tuning's that start it over once it has settled."""
CHECK_STEPS = 5
"""Steps after the tuning settles whose median the step's check against the plan is taken over
(:class:`SettledSteps`)."""


def next_count(planned: int, most: int, measured: dict[int, float]) -> int | None:
    """The count to try after those ``measured`` (count -> mean step seconds, in the order tried), or None when
    the tuning is done.

    A plan of none (its floor says device steps do not pay) is tried as it is, then a third of the host groups, then
    twice that if it was faster. Otherwise the plan's count is where the floor balances the host's Adam against
    copies it prices as overlapping the whole step; they overlap only the next forward, so its count is the most the
    copies may allow, and steps under it leave work to the next (13B on the H200: the plan's 7 ran 2.03 and 2.55 s,
    4 ran 1.78 s, 2 ran 1.43 s). So the tuning starts at half the plan's count (at least one), then half of that,
    then a step further the way that was faster: down to an eighth of the plan's, or up to three quarters of it.
    On the rows measured (13B on the H200, 10B and 2.7B on the H100) the fastest count lay in those three.

    Starting at a quarter was tried and reverted: at 13B on the H200 random tokens clip the first four steps, and
    the steps that pay for their updates ran 2.0-2.4 s whatever the count in force, against 1.43 s settled. Begun at
    2, the tuning measured 2 slow, went on down to none and settled there at 1.67 s, where 1 settles at 1.43 s
    (``bench/results/2026-11-27-h200-matrix-13b-*-72e71da.out``). The tuner now starts over when that timing changes
    (:class:`DeviceStepTuner`)."""
    tried = list(measured)
    if len(tried) >= MAX_TRIALS or most <= 0 and tried:
        return None
    if not planned:
        if not tried:
            return 0
        following = max(1, round(most / 3)) if len(tried) == 1 else (
            min(most, 2 * tried[1]) if measured[tried[1]] < measured[tried[0]] else None)
    else:
        first = min(most, max(1, round(planned / 2)))
        if not tried:
            return first
        if len(tried) == 1:
            following = round(first / 2)
        else:
            lower = measured[tried[1]] < measured[tried[0]]
            following = round(first / 4) if lower else min(most, round(3 * planned / 4))
    return following if following is not None and following not in measured else None


@dataclass(slots=True)
class DeviceStepTuner:
    """Tries counts as measured step times come in (:func:`next_count`), then settles on the fastest.

    Counts are compared under one update timing. A step whose host updates wait for the global norm (the step
    before it clipped, so this one is expected to) runs them after backward; one that speculates runs them during
    it. The two cost different counts differently: at 13B on the H200, random tokens clipped the first four steps,
    and the steps that waited for the norm ran 2.0-2.4 s whatever the count, against 1.43 s once the updates ran in
    backward. A tuning begun under the first timing measured its first count slow and the later ones fast, and so
    chose by the clip, not the count. So when a measured step's timing differs from that of the measurements so
    far, the tuning starts over from its first count, and that step is not counted. Once settled, it starts over
    where :data:`RETUNE_STEPS` steps in a row run under the other timing: a run that clips through its first hundred
    steps settles on the count for waiting updates, and keeps training long after its norm has fallen. Either
    happens at most :data:`RESTARTS` times, so that a run whose norm hovers at the threshold still settles.

    A plan with no count to tune (no host groups to step on the device, or a count the config fixes) is measured the
    same way by a ``fixed`` tuner, so that its step is checked against the plan's prediction under one update
    timing too: it keeps ``planned`` and tries no other.

    Args:
        planned: the plan's device-step count (the tuner's first count is put in force in its stead, unless fixed).
        most: host groups there are to step.
        fixed: measure ``planned`` alone.
    """

    planned: int
    most: int
    fixed: bool = False
    current: int = field(init=False)
    """The count in force: the first to try (:func:`next_count`) until the tuning moves on."""
    measured: dict[int, float] = field(init=False, default_factory=dict)
    """Count -> the mean of its measured steps, seconds, in the order tried."""
    done: bool = field(init=False, default=False)
    waited_for_norm: bool | None = field(init=False, default=None)
    """The update timing of the measurements so far (None before any, or where the steps do not say)."""
    restarts: int = field(init=False, default=0)
    """Times the tuning started over for a change of the update timing."""
    _steps: list[float] = field(init=False, default_factory=list)
    _seen: int = field(init=False, default=0)
    _other_timing: int = field(init=False, default=0)  # (settled: steps in a row under the other timing)

    def __post_init__(self) -> None:
        if not 0 <= self.planned <= max(0, self.most):
            raise ValueError(f"planned device steps {self.planned} must lie in 0..{self.most}")
        self.current = self._first()

    def _first(self) -> int:
        """The count the tuning (and a restart) begins with."""
        return self.planned if self.fixed else next_count(self.planned, self.most, {})

    @property
    def counts(self) -> list[int]:
        """The counts tried so far, in order (the one in force last)."""
        return list(dict.fromkeys([*self.measured, self.current]))

    @property
    def best(self) -> int:
        """The fastest count measured so far (the one in force before any measurement); the fewest among equals."""
        if not self.measured:
            return self.current
        return min(self.measured, key=lambda count: (self.measured[count], count))

    def observe(self, step_seconds: float, *, waited_for_norm: bool | None = None) -> int | None:
        """One step's measured time under :attr:`current`; returns the count to switch to now, or None to stay.

        ``waited_for_norm``: whether the step's host updates waited for the global norm (None: not known, every
        step alike). Once settled, returns the first count where the tuning starts over (:attr:`done` is False
        again), else None."""
        if self.done:
            changed = waited_for_norm is not None and self.waited_for_norm not in (None, waited_for_norm)
            self._other_timing = self._other_timing + 1 if changed else 0
            if self._other_timing >= RETUNE_STEPS and self.restarts < RESTARTS:
                return self._restart()
            return None
        self._seen += 1
        if self._seen <= SETTLE_STEPS:
            return None
        if waited_for_norm is not None and self.measured and self.waited_for_norm not in (None, waited_for_norm) \
                and self.restarts < RESTARTS:
            return self._restart()
        if waited_for_norm is not None and self.waited_for_norm is None:
            self.waited_for_norm = waited_for_norm
        others = [seconds for count, seconds in self.measured.items() if count != self.current]
        self._steps.append(step_seconds)
        self.measured[self.current] = sum(self._steps) / len(self._steps)
        too_slow = bool(others) and step_seconds > SLOW_FACTOR * min(others)
        if self._seen < SETTLE_STEPS + MEASURED_STEPS and not too_slow:
            return None
        self._seen, self._steps = 0, []
        following = None if self.fixed else next_count(self.planned, self.most, self.measured)
        previous = self.current
        if following is None:
            self.done = True
            following = self.best
        self.current = following
        return following if following != previous else None

    def _restart(self) -> int | None:
        """Start over from the first count (the update timing changed); returns it where it is a switch."""
        self.restarts += 1
        self.measured, self.waited_for_norm, self.done = {}, None, False
        self._seen, self._steps, self._other_timing = 0, [], 0
        previous, self.current = self.current, self._first()
        return self.current if self.current != previous else None

    def summary(self) -> str:
        """``5 groups (7: 0.604 s, 5: 0.545 s, ...)``: the choice, then each count tried with its mean step."""
        tried = ", ".join(f"{count}: {seconds:.3f} s" for count, seconds in self.measured.items())
        return f"{self.best} groups ({tried})"


@dataclass(slots=True)
class SettledSteps:
    """The steps after the tuning settles, under one update timing: what the step's check against the plan's
    prediction is taken over (their median, and the rates timed over them), not the tuning's own measurements.

    Those can run well above the steps that follow them: at 2.7B under a 22 GB cap on an H200, run after DeepSpeed
    in the same call, the tuning measured 0.924, 1.030 and 0.888 s for its three counts, and the settled count's steps
    then ran 0.59-0.69 s; its host's Adam was timed at 2.2 G elements/s over the trials. The check logged "+23%"
    against a prediction made at that rate. A step whose update timing differs from those collected so far starts the
    collection over from it (the check compares one timing with its prediction)."""

    steps: list[float] = field(default_factory=list)
    backwards: list[float] = field(default_factory=list)
    waited_for_norm: bool | None = None
    """The update timing of the steps collected (None before any, or where the steps do not say)."""

    def add(self, step_seconds: float, backward_seconds: float | None = None, *,
            waited_for_norm: bool | None = None) -> bool:
        """One settled step; returns whether :data:`CHECK_STEPS` of one timing are in."""
        if waited_for_norm is not None and self.waited_for_norm not in (None, waited_for_norm):
            self.steps, self.backwards = [], []
        if waited_for_norm is not None:
            self.waited_for_norm = waited_for_norm
        self.steps.append(step_seconds)
        if backward_seconds is not None:
            self.backwards.append(backward_seconds)
        return len(self.steps) >= CHECK_STEPS

    @property
    def step(self) -> float:
        """The median step collected."""
        return statistics.median(self.steps)

    @property
    def backward(self) -> float | None:
        """The median backward collected, where they were timed."""
        return statistics.median(self.backwards) if self.backwards else None
