"""The training engine and its precision: ``initialize()``, :class:`Engine` and the DeepSpeed methods it carries,
the fp32-master optimizer, loss scaling, the bf16-on-CPU check, LR schedules, expert parallelism, and the
``zero.Init`` / ``GatheredParameters`` helpers that build and edit the model around it."""
