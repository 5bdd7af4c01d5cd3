"""What a launched rank needs before training: DeepSpeed's command-line flags (``arguments``), the process group
from the launcher's environment (``distributed``), heartbeats between ranks (``liveness``) and where log lines go
(``log_output``)."""
