"""``angelptm.ops``: the DeepSpeed ops that scripts build optimizers from (``ops.adam``).

DeepSpeed's other ops (``lamb``, ``adagrad``, ``lion``, ``transformer``, ...) are not provided; the
README's compatibility table says what to use instead.
"""

from angelptm.ops import adam

__all__ = ["adam"]
