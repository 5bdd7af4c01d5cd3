"""AutoPipe: op-level profiling and balanced pipeline-stage partitioning.

Never imports ``angelptm``; owns its typed config. The pieces, lowest first: ``cost`` (stage time and
memory over a chain of op units), ``search`` (exact min-max split, by-layer baselines), ``graph`` (trace,
cut, slice), ``timing``/``calibration`` (per-op timers; op times fitted to a whole-graph run),
``profile``/``profiler`` (measured op costs as JSON), ``runtime`` (stages and schedules on
``torch.distributed.pipelining``), ``timeline`` (predicted flush, PNG), ``cli`` (``python -m autopipe``).
"""

from autopipe.config import AutoPipeConfig
from autopipe.cost import CostChain, CostSettings
from autopipe.search import PlanPrediction, PlanReport, plan_with_baselines, search

__all__ = ["AutoPipeConfig", "CostChain", "CostSettings", "PlanPrediction", "PlanReport", "plan_with_baselines",
           "search"]
