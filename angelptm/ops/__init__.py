"""``angelptm.ops``: the DeepSpeed ops that scripts build optimizers from (``ops.adam``).

DeepSpeed's other ops (``lamb``, ``adagrad``, ``lion``, ``transformer``, ...) are not provided; the
README's compatibility table says what to use instead.
"""

from angelptm.ops import adam, op_builder

__compatible_ops__ = dict.fromkeys(op_builder.ALL_OPS, False)
"""DeepSpeed's op name -> whether it can be built here: none can (see ``op_builder``)."""

__all__ = ["adam", "op_builder"]
