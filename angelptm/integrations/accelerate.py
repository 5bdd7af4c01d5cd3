"""accelerate's DeepSpeed path on this engine: one import at the top of an unmodified ``Accelerator`` script.

    import angelptm.integrations.accelerate   # before anything imports deepspeed
    from accelerate import Accelerator, DeepSpeedPlugin
    ...

accelerate drives DeepSpeed from inside its own code (``import deepspeed`` in ``Accelerator._prepare_deepspeed``,
``from deepspeed import DeepSpeedEngine`` in ``unwrap_model``, ``deepspeed.checkpoint.utils`` in
``get_state_dict``, ``deepspeed.comm`` under a launcher), so this import makes ``deepspeed`` another name of
``angelptm`` for the whole process (:mod:`angelptm.integrations.deepspeed_alias`). accelerate's own code then
runs unchanged on this engine: it fills the config's ``"auto"`` values exactly as it fills them for DeepSpeed,
``accelerator.backward`` calls ``engine.backward`` and, at the accumulation boundary, ``engine.step``;
``unwrap_model`` finds the module under :class:`angelptm.DeepSpeedEngine`; ``get_state_dict`` under ZeRO-3
reads ``_zero3_consolidated_16bit_state_dict``; ``save_state`` / ``load_state`` call ``save_checkpoint`` /
``load_checkpoint``. accelerate's ``steps_per_print: Infinity`` means "never print" here too.

A ``DeepSpeedPlugin`` whose stage is 3 builds ``from_pretrained`` / ``from_config`` models under
``deepspeed.zero.Init``, which is :class:`angelptm.zero.Init` here: whole parameters in the compute dtype
(in host memory when the config offloads params), moved into ZeRO-Cache at ``prepare``.

Not available through this route (they raise, naming the missing ``deepspeed.X``): DeepSpeed tensor and
sequence parallelism (``tensor_parallel.autotp_size``, Ulysses), MS-AMP fp8.
"""

from angelptm.integrations import deepspeed_alias

deepspeed_alias.install()
