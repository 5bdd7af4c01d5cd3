"""Lightning's ``DeepSpeedStrategy`` on this engine: one import at the top of an unmodified Lightning script.

    import angelptm.integrations.lightning   # before anything imports deepspeed
    import lightning.pytorch as pl
    trainer = pl.Trainer(strategy=DeepSpeedStrategy(stage=3, offload_optimizer=True), ...)

Lightning imports DeepSpeed inside its strategy (``deepspeed.utils.logging``, ``deepspeed.init_distributed``,
``deepspeed.initialize``, ``deepspeed.zero.Init`` / ``GatheredParameters``, ``deepspeed.checkpointing``,
``deepspeed.runtime.base_optimizer``), so, as for accelerate, this import makes ``deepspeed`` another name of
``angelptm`` for the process (:mod:`angelptm.integrations.deepspeed_alias`) and Lightning's own code runs on this
engine. The config Lightning builds (its ``zero_optimization`` defaults, ``aio``, ``activation_checkpointing``)
loads here; the keys that do nothing here are listed once in a warning. ZeRO stage 3 with ``offload_optimizer`` /
``offload_parameters`` runs on ZeRO-Cache.

Lightning's DeepSpeed strategy itself requires CUDA (``setup_environment`` refuses other accelerators).
"""

from angelptm.integrations import deepspeed_alias

deepspeed_alias.install()
