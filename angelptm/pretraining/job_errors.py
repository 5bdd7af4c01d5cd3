"""What ``pretrain.py`` prints for the failures a user can act on: one ``error:`` line and an exit status, no traceback.

Bad input (config, data, checkpoints), a full disk, a device out of memory, a ZeRO-Cache tier over its
budget, a lost rank and a collective that timed out each end the job with a line that names the cause and
the setting or action that helps. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from angelptm.checkpoints.files import DISK_FULL
from angelptm.errors import CheckpointError, ConfigError, DataError
from angelptm.launch.distributed import RendezvousError
from angelptm.launch.liveness import EXIT_CODE as LOST_RANK_EXIT
from angelptm.launch.liveness import RankLostError
from angelptm.memory.oom import StepOutOfMemoryError
from zero_cache import SwapCorruptionError, TierFullError

BAD_INPUT_EXIT = 2
"""Exit status of a job stopped by its input or its machine's limits (argparse's status for bad arguments)."""
UNHEALTHY_EXIT = 3
"""Exit status of a run stopped because it stopped training (no healthy step for train.max_bad_steps steps) or its
swap file was corrupted: its later checkpoints are not to be trusted."""


class RunUnhealthyError(RuntimeError):
    """No healthy step (applied, finite loss) in ``train.max_bad_steps`` consecutive steps; names the last healthy
    checkpoint."""


class CommsTimeoutError(RuntimeError):
    """A collective waited ``comms.timeout_s`` and failed while every rank still beat; the message names the rank."""


def one_line(err: BaseException) -> tuple[str, int] | None:
    """The ``error:`` line and exit status for an error the user can act on, or None (a bug: keep the traceback)."""
    if isinstance(err, (ConfigError, CheckpointError, DataError, StepOutOfMemoryError)):
        return f"error: {err}", BAD_INPUT_EXIT
    if isinstance(err, TierFullError):
        return (f"error: {err}. The plan should have kept every tier within its budget (please report this with the "
                "output of `pretrain.py --plan`); raising that tier's zero_cache.*_memory_budget works around it",
                BAD_INPUT_EXIT)
    if isinstance(err, OSError) and err.errno in DISK_FULL:  # the NVMe tier's swap file, or another write
        return (f"error: no space left on the disk holding {err.filename or 'a file this job writes'} "
                f"({err.strerror or err}). Free space there, lower zero_cache.nvme_memory_budget or point "
                "zero_cache.nvme_path at a larger disk when it is the NVMe tier's; the last checkpoint is kept",
                BAD_INPUT_EXIT)
    if isinstance(err, (RunUnhealthyError, SwapCorruptionError)):
        return f"error: {err}", UNHEALTHY_EXIT
    if isinstance(err, (RankLostError, CommsTimeoutError, RendezvousError)):
        return f"error: {err}", LOST_RANK_EXIT
    return None


def comms_timeout(err: BaseException, rank: int, world_size: int, timeout_s: float) -> CommsTimeoutError | None:
    """A collective's timeout (gloo's "Timed out waiting ...ms", NCCL's watchdog) as an error naming this rank and
    ``comms.timeout_s``; None for other errors. Call it once the heartbeat found no rank lost."""
    text = str(err)
    if world_size < 2 or not any(word in text for word in ("Timed out", "timed out", "Timeout", "timeout")):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return CommsTimeoutError(
        f"rank {rank} of {world_size}: a collective waited comms.timeout_s = {timeout_s:g} s and timed out while "
        "every rank's heartbeat still beat, so no rank died: one is stuck in its own work (a long checkpoint save "
        "or data load; raise comms.timeout_s to cover it) or the ranks called different collectives (a bug in the "
        f"training script). ({first})")

