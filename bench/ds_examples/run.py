"""Run a DeepSpeedExamples script under DeepSpeed or angelptm, side by side, on a CPU (issue 28).

    python bench/ds_examples/run.py {deepspeed,angelptm} SCRIPT [ARGS...]      # (torchrun for pipeline_parallelism)

Only the script's ``import deepspeed`` / ``from deepspeed.X`` lines change for angelptm. Two stand-ins make the
scripts run on this CPU machine, the same for both backends:

* ``standin/torchvision``: the torchvision pieces the scripts use (``FakeData``, ``CIFAR10`` as random images of
  its shape, sized by ``SHIM_CIFAR_TRAIN`` / ``SHIM_CIFAR_TEST``; ``Compose``, ``ToTensor``, ``Normalize``,
  ``Resize``, ``CenterCrop``; ``AlexNet``; ``save_image`` as a no-op). torchvision from PyPI is built against CUDA
  torch and does not load with the CPU torch here.
* ``torch.utils.tensorboard.SummaryWriter`` as a no-op (tensorboard is not installed).

The DCGAN script's CUDA-only lines (``torch.cuda.set_device``, ``torch.device("cuda", ...)``,
``torch.cuda.synchronize()``) become their CPU equivalents. Commands used (from the script's folder, with
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=... for one process):

    gan:      run.py B gan_deepspeed_train.py --dataset fake --workers 0 --ngf 16 --ndf 16 \
                  --deepspeed_config gan_deepspeed_config.json
    cifar:    SHIM_CIFAR_TRAIN=256 SHIM_CIFAR_TEST=64 run.py B cifar10_deepspeed.py --dtype fp32 --epochs 1 \
                  --log-interval 2
    pipeline: SHIM_CIFAR_TRAIN=256 torchrun --nproc-per-node 2 run.py B train.py --backend gloo \
                  --deepspeed_config ds_config.json (train_batch_size 16, micro 8, steps_per_print 1) -s 4 -p 2
"""

import os
import re
import sys
import types

backend, script, *argv = sys.argv[1:]
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(here, "standin"), os.path.dirname(os.path.abspath(script))]
board = types.ModuleType("torch.utils.tensorboard")
board.SummaryWriter = type("SummaryWriter", (), {"__init__": lambda self, *a, **k: None,
                                                 "add_scalar": lambda self, *a, **k: None})
sys.modules["torch.utils.tensorboard"] = board
source = open(script).read()
if backend == "deepspeed":
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo alone, no JIT build of its CPU op
else:
    source = re.sub(r"^import deepspeed$", "import angelptm as deepspeed", source, flags=re.M)
    source = re.sub(r"^from deepspeed\.", "from angelptm.", source, flags=re.M)
source = source.replace("torch.cuda.set_device(args.local_rank)", "pass")
source = source.replace('torch.device("cuda", args.local_rank)', 'torch.device("cpu")')
source = source.replace("torch.cuda.synchronize()", "pass")
sys.argv = [script, *argv]
exec(compile(source, script, "exec"), {"__name__": "__main__", "__file__": script})
