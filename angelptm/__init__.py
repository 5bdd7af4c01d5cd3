"""AngelPTM-style pretraining engine with DeepSpeed's API.

Switch a DeepSpeed script by changing one import::

    import angelptm as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")

The names a DeepSpeed script touches live where DeepSpeed has them: ``add_config_arguments``,
``init_distributed``, ``comm``, ``accelerator.get_accelerator``, ``checkpointing`` (also as
``runtime.activation_checkpointing.checkpointing``), ``zero.Init``, ``moe.layer.MoE``, ``ops.adam``,
``runtime.lr_schedules``, ``runtime.utils``, ``utils.zero_to_fp32`` and ``pipe`` (README: "DeepSpeed
compatibility" lists each, and what is not supported).

Nothing else sits at the top level but ``errors`` and one package per concern (README: "Where things live"):
``config`` (DeepSpeed JSON -> typed dataclasses), ``engine`` (initialize, the engine and its precision),
``checkpoints``, ``launch`` (flags, process group, liveness), ``memory`` (does it fit), ``telemetry``,
``pretraining`` (the job's data, models and AutoPipe loop) and ``integrations`` (transformers).
"""

from angelptm import accelerator, comm, moe, ops, pipe, runtime, utils, zero
from angelptm.comm import init_distributed
from angelptm.config import EngineConfig, load_config
from angelptm.engine.engine import Engine
from angelptm.engine.engine import Engine as DeepSpeedEngine  # DeepSpeed's name (accelerate's isinstance checks)
from angelptm.engine.initialize import initialize
from angelptm.errors import CheckpointError, ConfigError
from angelptm.launch.arguments import add_config_arguments
from angelptm.pipe import PipelineModule
from angelptm.pipe.engine import PipelineEngine
from angelptm.runtime.activation_checkpointing import checkpointing

__version__ = "0.1.0"
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split("."))
__git_hash__ = __git_branch__ = "[none]"  # DeepSpeed's attributes (an installed package, not a checkout)

__all__ = ["CheckpointError", "ConfigError", "DeepSpeedEngine", "Engine", "EngineConfig", "PipelineEngine",
           "PipelineModule", "accelerator", "add_config_arguments", "checkpointing", "comm", "init_distributed",
           "initialize", "load_config", "moe", "ops", "pipe", "runtime", "utils", "zero", "__version__"]
