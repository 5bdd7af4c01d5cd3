"""Deciding: the planner and everything it prices with (pure functions over plain dataclasses, no torch).

What the plan is made of (:mod:`~zero_cache.plan.placement`: ``PlanInputs``, ``Plan``, ``PlanError``), how it
is made (:mod:`~zero_cache.plan.planner`), what each home and state home costs
(:mod:`~zero_cache.plan.home_costs`, :mod:`~zero_cache.plan.state_costs`), the step's traffic and floor
(:mod:`~zero_cache.plan.step_cost`), the working set, Belady's eviction rule, the chunk layout, the order of a
re-plan's moves, the device-step count chosen from measured step times (:mod:`~zero_cache.plan.tuning`), tier names
and byte units.

Nothing here imports torch, nor ``zero_cache.storage``, ``zero_cache.runtime`` or ``zero_cache.optim``:
``import zero_cache.plan.planner`` works where torch is not installed (``tests/unit/test_layering.py``). This
``__init__`` imports nothing.
"""
