"""``deepspeed.runtime.zero``: ZeRO's config models (``config``) and the construction names libraries import from
``partition_parameters`` (``Init``, ``GatheredParameters``: this package's :mod:`angelptm.zero`)."""

from angelptm.runtime.zero import config, partition_parameters
from angelptm.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "config", "partition_parameters"]
