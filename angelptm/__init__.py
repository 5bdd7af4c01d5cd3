"""AngelPTM-style pretraining engine with DeepSpeed's API.

Switch a DeepSpeed script by changing one import::

    import angelptm as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")
"""

from angelptm import zero
from angelptm.api import initialize
from angelptm.config import EngineConfig, load_config
from angelptm.engine import Engine
from angelptm.errors import CheckpointError, ConfigError

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "Engine", "EngineConfig", "initialize", "load_config", "zero",
           "__version__"]
