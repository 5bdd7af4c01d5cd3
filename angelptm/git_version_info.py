"""``deepspeed.git_version_info``: what this package is and was built against (DeepSpeed's keys).

``installed_ops`` is empty: DeepSpeed's prebuilt native ops are not part of this package (angelptm builds its own
``csrc/`` on first use). ``torch_info`` describes the torch this process runs.
"""

import torch

from angelptm import __version__ as version  # noqa: F401  (DeepSpeed's git_version_info.version)

git_hash = "[none]"
git_branch = "[none]"
installed_ops: dict[str, bool] = {}
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
torch_info = {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
              "cuda_version": torch.version.cuda or "0.0", "nccl_version": "0.0", "hip_version": "0.0"}
