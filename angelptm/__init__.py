"""AngelPTM-style pretraining engine with DeepSpeed's API.

Switch a DeepSpeed script by changing one import::

    import angelptm as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")

The names a DeepSpeed script touches live where DeepSpeed has them: ``add_config_arguments``,
``init_distributed``, ``comm``, ``accelerator.get_accelerator``, ``checkpointing``, ``zero.Init``,
``moe.layer.MoE``, ``ops.adam``, ``runtime.lr_schedules``, ``utils.zero_to_fp32`` and ``pipe``
(README: "DeepSpeed compatibility" lists each, and what is not supported).
"""

from angelptm import accelerator, comm, moe, ops, pipe, runtime, utils, zero
from angelptm.runtime.activation_checkpointing import checkpointing
from angelptm.engine.initialize import initialize
from angelptm.launch.arguments import add_config_arguments
from angelptm.comm import init_distributed
from angelptm.config import EngineConfig, load_config
from angelptm.engine.engine import Engine
from angelptm.errors import CheckpointError, ConfigError
from angelptm.pipe import PipelineModule
from angelptm.pipe.engine import PipelineEngine

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "Engine", "EngineConfig", "PipelineEngine", "PipelineModule",
           "accelerator", "add_config_arguments", "checkpointing", "comm", "init_distributed", "initialize",
           "load_config", "moe", "ops", "pipe", "runtime", "utils", "zero", "__version__"]
