"""``deepspeed.runtime.lr_schedules``: DeepSpeed's five schedules and their key names, from
:mod:`angelptm.engine.schedulers` and :mod:`angelptm.engine.cyclic_schedules` (DeepSpeed 0.19's formulas).

``VALID_LR_SCHEDULES`` lists them by name, as accelerate reads it to recognise a schedule object.
"""

from __future__ import annotations

from angelptm.engine.cyclic_schedules import LRRangeTest, OneCycle
from angelptm.engine.schedule_base import torch_optimizer as get_torch_optimizer
from angelptm.engine.schedule_base import write_lrs as update_lr
from angelptm.engine.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST, ONE_CYCLE = "LRRangeTest", "OneCycle"
WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                                               "warmup_type")
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "get_torch_optimizer", "update_lr"]
