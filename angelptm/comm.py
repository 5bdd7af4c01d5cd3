"""``angelptm.comm``: the part of ``deepspeed.comm`` that training scripts call, over ``torch.distributed``.

Each collective is ``torch.distributed``'s own function under DeepSpeed's name. DeepSpeed's extra
comms-logger arguments are accepted: ``log_name`` and ``debug`` are labels and are dropped; ``prof=True``
asks for DeepSpeed's comms logger, which is not built, and raises (use ``torch.profiler``).

Before a process group exists (a single process that never joined one) :func:`get_rank`,
:func:`get_world_size`, :func:`get_local_rank` and :func:`barrier` answer for a world of one, as
DeepSpeed does after ``init_distributed()`` in one process; the collectives need a group.
"""

from __future__ import annotations

import datetime
import functools
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from angelptm.errors import ConfigError
from angelptm.launch.distributed import check_launcher_env
from angelptm.launch.distributed import init_distributed as _join_process_group

__all__ = ["ProcessGroup", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
           "all_to_all_single", "allgather_fn", "barrier", "broadcast", "broadcast_object_list",
           "destroy_process_group", "gather", "get_global_rank", "get_local_rank", "get_rank", "get_world_group",
           "get_world_size", "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "inference_all_reduce",
           "init_distributed", "irecv", "is_available", "is_initialized", "isend", "monitored_barrier", "new_group",
           "recv", "reduce", "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send"]

_DEFAULT_TIMEOUT_MIN = 30


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the default process group, like ``deepspeed.init_distributed`` (same arguments).

    Under torchrun or the ``deepspeed`` launcher the ``env://`` rendezvous is used (gloo on CPU, NCCL on
    GPUs, or ``dist_backend``). A single process started without a launcher joins a world of one over an
    in-process store, so every ``comm`` call works.

    Args:
        dist_backend: "nccl", "gloo", ... (None: NCCL with CUDA, gloo otherwise).
        auto_mpi_discovery: DeepSpeed reads an MPI launcher's environment when RANK is unset; not built here:
            with OMPI_COMM_WORLD_SIZE > 1 and no RANK this raises and says to use torchrun.
        distributed_port: used only with ``auto_mpi_discovery`` in DeepSpeed; ignored.
        verbose: ignored (the join is logged at INFO).
        timeout: collective timeout (default: DEEPSPEED_TIMEOUT minutes, else 30, as DeepSpeed).
        init_method: a torch ``init_method`` URL (needs ``rank`` and ``world_size``); None = ``env://``.
        dist_init_required: False = a group must already exist; None/True = join one if none exists.
        config: DeepSpeed's comms-logger config; must be None (the logger is not built).
        rank, world_size: for ``init_method`` URLs that need them (-1 = from the environment).

    Raises:
        ConfigError: an MPI-only launch, or ``dist_init_required=False`` without a group.
        NotImplementedError: ``config`` given.
    """
    if config is not None:
        raise NotImplementedError("init_distributed(config=...) configures DeepSpeed's comms logger, which angelptm "
                                  "does not have; drop the argument and use torch.profiler for communication timings")
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ConfigError("init_distributed(dist_init_required=False) but no process group exists; call "
                          "torch.distributed.init_process_group first or drop the argument")
    if "RANK" not in os.environ and int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1 and auto_mpi_discovery:
        raise ConfigError("started by mpirun without RANK/WORLD_SIZE: MPI discovery is not supported; start the job "
                          "with torchrun or the deepspeed launcher")
    timeout = timeout or datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", _DEFAULT_TIMEOUT_MIN)))
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if init_method is not None:
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size)
    elif "RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if dist_backend is None:  # the engine's own join: env:// rendezvous, device picked from LOCAL_RANK
            _join_process_group(dist_init_required=True, timeout_s=timeout.total_seconds())
        else:
            check_launcher_env()  # (a rank outside the world would wait at the rendezvous until the timeout)
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:  # one process without a launcher: an in-process store is the whole rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_initialized()


def is_available() -> bool:
    """Whether torch was built with distributed support."""
    return dist.is_available()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); 0 before any group exists."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Processes in ``group`` (default: the world); 1 before any group exists."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """Rank on this host, from the launcher's LOCAL_RANK (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_group() -> ProcessGroup:
    """The default (world) process group."""
    return dist.group.WORLD


def get_global_rank(group: ProcessGroup | None = None, group_rank: int = 0) -> int:
    """The global rank of ``group_rank`` in ``group`` (the world when None)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None,
            prof: bool = False, log_name: str = "barrier", debug: Any = None) -> Any:
    """``torch.distributed.barrier``; nothing to wait for before any group exists."""
    _check_prof(prof)
    if not dist.is_initialized():
        return None
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def _check_prof(prof: bool) -> None:
    if prof:
        raise NotImplementedError("prof=True asks for DeepSpeed's comms logger, which angelptm does not have; "
                                  "drop it and time communication with torch.profiler")


def _deepspeed_signature(function: Callable) -> Callable:
    """``function`` accepting DeepSpeed's comms-logger keywords (``prof`` must stay False)."""

    @functools.wraps(function)
    def call(*args: Any, prof: bool = False, log_name: str | None = None, debug: Any = None, **kwargs: Any) -> Any:
        _check_prof(prof)
        return function(*args, **kwargs)

    return call


broadcast = _deepspeed_signature(dist.broadcast)
broadcast_object_list = _deepspeed_signature(dist.broadcast_object_list)
all_reduce = _deepspeed_signature(dist.all_reduce)
inference_all_reduce = all_reduce
reduce = _deepspeed_signature(dist.reduce)
all_gather = _deepspeed_signature(dist.all_gather)
all_gather_object = _deepspeed_signature(dist.all_gather_object)
all_gather_into_tensor = _deepspeed_signature(dist.all_gather_into_tensor)
allgather_fn = all_gather_into_tensor
reduce_scatter = _deepspeed_signature(dist.reduce_scatter)
reduce_scatter_tensor = _deepspeed_signature(dist.reduce_scatter_tensor)
reduce_scatter_fn = reduce_scatter_tensor
all_to_all_single = _deepspeed_signature(dist.all_to_all_single)
gather = _deepspeed_signature(dist.gather)
scatter = _deepspeed_signature(dist.scatter)
send = _deepspeed_signature(dist.send)
recv = _deepspeed_signature(dist.recv)
isend = _deepspeed_signature(dist.isend)
irecv = _deepspeed_signature(dist.irecv)
monitored_barrier = _deepspeed_signature(dist.monitored_barrier)
new_group = dist.new_group
destroy_process_group = dist.destroy_process_group


def has_all_gather_into_tensor() -> bool:
    """Always True: torch has ``all_gather_into_tensor``."""
    return True


def has_reduce_scatter_tensor() -> bool:
    """Always True: torch has ``reduce_scatter_tensor``."""
    return True
