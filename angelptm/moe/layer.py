"""``deepspeed.moe.layer.MoE``: the project's MoE layer (:class:`moe.layer.MoE`), which takes DeepSpeed's
constructor arguments and returns ``(output, l_aux, exp_counts)``.

Arguments it cannot honour raise ``ValueError`` naming the alternative: ``enable_expert_tensor_parallelism``
(no tensor parallelism) and ``set_deepspeed_parallelism(use_data_before_expert_parallel_=True)``.
``use_tutel`` is accepted and has no effect (the grouped-GEMM experts are used).
"""

from moe.layer import MoE

__all__ = ["MoE"]
