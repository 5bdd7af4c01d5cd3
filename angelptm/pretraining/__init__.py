"""The pretraining job behind ``pretrain.py``: its data (``data``), the reference GPT models (``models``), the
AutoPipe pipeline-parallel job (``pipeline_parallel``) and the error lines it prints (``job_errors``)."""
