"""``angelptm.pipe``: DeepSpeed's pipeline-module API (``deepspeed.pipe``) on AutoPipe's runtime.

``PipelineModule(layers, num_stages, loss_fn, partition_method=...)`` given to :func:`angelptm.initialize`
returns a :class:`~angelptm.pipe.engine.PipelineEngine`; train it with ``engine.train_batch(data_iter)``.
"""

from angelptm.pipe.module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
