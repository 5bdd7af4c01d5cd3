"""The training engine and its precision: ``initialize()`` (``initialize``) and the steps it shares with the
pipeline engine (``builders``), :class:`~angelptm.engine.engine.Engine` and the DeepSpeed methods it carries
(``engine``, ``deepspeed_methods``), the fp32-master optimizer and loss scaling (``mixed_precision``,
``loss_scaler``), the bf16-on-CPU check (``cpu_bf16``), LR schedules (``schedulers``), expert parallelism
(``expert_parallel``), and the ``zero.Init`` / ``GatheredParameters`` helpers that build and edit the model
around it (``init_on_device``, ``gathered_params``)."""
