"""Process-group set-up from the launcher's environment (torchrun or the ``deepspeed`` launcher).

Both launchers export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so the
``env://`` rendezvous covers them; a plain ``python script.py`` is a world of one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from angelptm.errors import ConfigError
from angelptm.launch.liveness import RankWatchdog, ended_by_exception, note_uncaught_exceptions

logger = logging.getLogger(__name__)

WAIT_NOTE_AFTER_S = 30.0
"""A rendezvous still waiting after this long is logged (the ranks of a job that a scheduler starts node by node
can take tens of seconds to meet: a note sooner would be noise on every healthy start)."""
WAIT_NOTE_EVERY_S = 60.0
"""... and again every this long while it waits (torch itself says nothing until ``comms.timeout_s`` ends)."""



@dataclass(kw_only=True, slots=True)
class DistContext:
    """Where this process sits in the data-parallel world."""

    rank: int
    """Global rank."""
    world_size: int
    """Data-parallel ranks."""
    local_rank: int
    """Rank within this host (selects the GPU)."""
    device: torch.device
    """Compute device of this rank."""
    group: dist.ProcessGroup | None
    """The data-parallel group, or None in a single-process run."""
    local_world_size: int = 1
    """Ranks on this host (the launcher's LOCAL_WORLD_SIZE): they share its RAM."""
    watchdog: RankWatchdog | None = None
    """The lost-rank heartbeat, when this context's :func:`init_distributed` created the group with one."""

    @property
    def is_main(self) -> bool:
        """True on the rank that writes shared files and logs."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op for a single process)."""
        if self.group is not None:
            dist.barrier(group=self.group)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is true on any (e.g. all ranks must stop at the same step)."""
        if self.group is None:
            return flag
        tensor = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return bool(tensor.item())


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def launcher_world_size() -> int:
    """Ranks of this job as the process group has them, or as the launcher announced them (before joining).

    Raises:
        ConfigError: the launcher's variables contradict each other (:func:`check_launcher_env`).
    """
    if dist.is_initialized():
        return dist.get_world_size()
    return check_launcher_env()


def check_launcher_env() -> int:
    """The launcher's WORLD_SIZE (1 without one), once RANK and LOCAL_RANK are found inside their worlds.

    A rank at or above the world size would wait at the rendezvous for a place that does not exist until
    ``comms.timeout_s`` ran out, saying nothing; it is refused here, at once.

    Raises:
        ConfigError: naming the variables, their values and the values allowed.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={world_size}: must be >= 1 (the job's number of ranks)")
    for rank_name, size_name, size in (("RANK", "WORLD_SIZE", world_size),
                                       ("LOCAL_RANK", "LOCAL_WORLD_SIZE", _env_int("LOCAL_WORLD_SIZE", 0))):
        rank = _env_int(rank_name, 0)
        if rank < 0 or (size and rank >= size):
            allowed = f"0 .. {size - 1}" if size else "0 or more"
            raise ConfigError(f"environment variables {rank_name}={rank} and {size_name}={os.environ.get(size_name)}: "
                              f"{rank_name} must be one of {allowed}, so this rank would wait for a place in the job "
                              "that does not exist. Start the job with torchrun or the deepspeed launcher, which set "
                              "both, or fix the values exported by hand")
    return world_size


def init_distributed(*, dist_init_required: bool | None = None, timeout_s: float = 600.0,
                     lost_rank_after_s: float = 0.0, wait_note_after_s: float = WAIT_NOTE_AFTER_S) -> DistContext:
    """Join (or create) the default process group and pick this rank's device.

    Args:
        dist_init_required: None = initialise when the environment describes more than one rank;
            True = always initialise (a world of one is fine); False = never.
        timeout_s: collective timeout, so a hung collective produces an error instead of a hang
            (``comms.timeout_s``).
        lost_rank_after_s: when this call creates a group of several ranks, start a heartbeat that
            ends the job with the lost rank's name once one stands still this long
            (``comms.lost_rank_after_s``; 0 = none, see ``angelptm.launch.liveness``).
        wait_note_after_s: a rendezvous still waiting after this long is logged, with what it waits for and
            where (and again every :data:`WAIT_NOTE_EVERY_S`).

    Returns:
        This process's :class:`DistContext`. NCCL is used when CUDA is available, gloo otherwise.

    Raises:
        ConfigError: the launcher's variables contradict each other, or name no rendezvous.
        RendezvousError: the ranks did not all meet within ``timeout_s``.
        RendezvousAddressError: (a ConfigError) MASTER_PORT in use, MASTER_ADDR not resolvable, or another socket
            error well before ``timeout_s``.
    """
    world_size = check_launcher_env() if not dist.is_initialized() else _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count())) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    wanted = world_size > 1 if dist_init_required is None else dist_init_required
    watchdog = None
    if wanted and not dist.is_initialized():
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
            if name not in os.environ:
                raise ConfigError(
                    f"WORLD_SIZE={world_size} but {name} is not set; "
                    "start the job with torchrun or the deepspeed launcher"
                )
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        rank = _env_int("RANK", 0)
        with _noting_the_wait(rank, world_size, timeout_s, wait_note_after_s, local_rank=local_rank):
            # The env:// rendezvous that init_process_group would do, done here to keep the store for the heartbeat.
            store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
            store.set_timeout(timeout)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size, timeout=timeout,
                                    device_id=device if use_cuda else None)
        logger.info("joined process group: backend %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
        _destroy_at_clean_exit()  # (registered before the heartbeat's stop, so it runs after it)
        if lost_rank_after_s > 0 and size > 1:
            watchdog = RankWatchdog(store, rank, size, lost_rank_after_s)
        # Created here, with comms.timeout_s: a later initialize() in this process joins it and keeps this heartbeat.
        _HEARTBEATS[id(dist.distributed_c10d._get_default_store())] = watchdog
    elif lost_rank_after_s > 0 and dist.is_initialized() and dist.get_world_size() > 1:
        watchdog = _watch_existing_group(lost_rank_after_s)  # e.g. deepspeed.init_distributed() ran first
    if world_size > 1 and not dist.is_initialized():
        raise ConfigError(f"the launcher started {world_size} ranks (WORLD_SIZE={world_size}) but dist_init_required="
                          "False and no process group exists; initialise torch.distributed first or drop the argument")
    if dist.is_initialized():
        return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                           device=device, group=dist.group.WORLD,
                           local_world_size=_env_int("LOCAL_WORLD_SIZE", dist.get_world_size()), watchdog=watchdog)
    return DistContext(rank=0, world_size=1, local_rank=local_rank, device=device, group=None)


class RendezvousError(RuntimeError):
    """The ranks did not all meet within ``comms.timeout_s``; the message names this rank, the address and the cause."""


class RendezvousAddressError(ConfigError):
    """The rendezvous failed on MASTER_ADDR / MASTER_PORT themselves (the port in use, the address not resolvable,
    a socket error well before ``comms.timeout_s``): the launch is to fix, no rank was lost."""


NEAR_TIMEOUT_FRACTION = 0.9
"""A rendezvous error counts as its timeout only once this fraction of ``comms.timeout_s`` has passed: EADDRINUSE
comes at once, and calling it a timeout sent users after a rank that was never lost."""


def _master_address() -> str:
    return f"MASTER_ADDR:MASTER_PORT = {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def _address_problem(err: BaseException) -> str | None:
    """What is wrong with MASTER_ADDR / MASTER_PORT when ``err`` comes from them (None when nothing is known)."""
    text = str(err).lower()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if "eaddrinuse" in text or "address already in use" in text:
        return (f"port in use: MASTER_PORT={port} is already taken on this host (another job, or a process of an "
                "earlier run still alive); pick a free MASTER_PORT for every rank")
    try:
        socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError):
        return (f"address not resolvable: MASTER_ADDR={addr} does not resolve from this host; set it to rank 0's "
                "host name or IP address on every rank")
    return None


def _waiting_for(rank: int, world_size: int) -> tuple[str, str]:
    """What a rank waits for at the rendezvous, and what to check when the wait lasts."""
    where = _master_address()
    if rank == 0:
        others = world_size - 1
        return (f"the other {others} rank{'s' if others > 1 else ''} to join at {where} (this rank's store)",
                f"check that every rank has started with WORLD_SIZE={world_size} and the same MASTER_ADDR and "
                "MASTER_PORT")
    return (f"rank 0 at {where}", "check that rank 0 has started, that every rank has the same MASTER_ADDR and "
                                  "MASTER_PORT, and that this host reaches that address")


def _timed_out(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, (TimeoutError, dist.DistNetworkError, dist.DistStoreError)) or "timed out" in text \
        or "timeout" in text


@contextlib.contextmanager
def _noting_the_wait(rank: int, world_size: int, timeout_s: float, note_after_s: float, *,
                     local_rank: int = 0) -> Iterator[None]:
    """Log the rendezvous's wait from a daemon thread once it has lasted ``note_after_s``; turn its timing out into
    a :class:`RendezvousError` that says what it waited for. The note is a warning from each node's local rank 0
    (one line a node, however many ranks it runs) and a debug line from the others."""
    done, start = threading.Event(), time.monotonic()
    waiting_for, check = _waiting_for(rank, world_size)
    level = logging.WARNING if local_rank == 0 else logging.DEBUG

    def note() -> None:
        delay = note_after_s
        while not done.wait(delay):
            logger.log(level, "rank %d of %d: waiting %.0f s so far for %s (the rendezvous gives up after "
                           "comms.timeout_s = %g s); %s", rank, world_size, time.monotonic() - start, waiting_for,
                           timeout_s, check)
            delay = WAIT_NOTE_EVERY_S

    thread = threading.Thread(target=note, name="angelptm-rendezvous-note", daemon=True)
    thread.start()
    try:
        yield
    except (RuntimeError, TimeoutError) as err:  # (torch's DistError is a RuntimeError)
        if not _timed_out(err):
            raise
        elapsed_s = time.monotonic() - start
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        problem = _address_problem(err)
        if problem is not None or elapsed_s < NEAR_TIMEOUT_FRACTION * timeout_s:
            raise RendezvousAddressError(
                f"rank {rank} of {world_size}: the rendezvous at {_master_address()} failed after {elapsed_s:.1f} s "
                f"(comms.timeout_s = {timeout_s:g} s, so not a timeout): "
                f"{problem or 'a socket error; check MASTER_ADDR and MASTER_PORT'} ({first})") from err
        raise RendezvousError(f"rank {rank} of {world_size}: the ranks did not all meet within comms.timeout_s = "
                              f"{timeout_s:g} s, waiting for {waiting_for}; {check} ({first})") from err
    finally:
        done.set()
        thread.join()


_HEARTBEATS: dict[int, RankWatchdog | None] = {}
"""The heartbeat of each process group, keyed by its store: a process beats once however many engines it builds.
Groups this module created are entered when created (None: without a heartbeat), so joining one again neither
starts a second heartbeat nor claims that comms.timeout_s did not apply to it."""


def _watch_existing_group(lost_rank_after_s: float) -> RankWatchdog | None:
    """A heartbeat on the default group's store; its collective timeout was set by whoever created it."""
    store = dist.distributed_c10d._get_default_store()
    if _HEARTBEATS.get(id(store)) is None:  # created elsewhere, or here without a heartbeat (lost_rank_after_s 0)
        if id(store) not in _HEARTBEATS:
            logger.info("the process group was created before initialize(): comms.timeout_s does not apply to it "
                        "(pass timeout= where it is created); comms.lost_rank_after_s does")
        _HEARTBEATS[id(store)] = RankWatchdog(store, dist.get_rank(), dist.get_world_size(), lost_rank_after_s)
    return _HEARTBEATS[id(store)]


def _destroy_at_clean_exit() -> None:
    """Destroy the default group when the process ends without an uncaught exception, as DeepSpeed's scripts
    rarely do themselves. Left to interpreter teardown, gloo's worker threads can outlive the interpreter and abort
    the process ("terminate called without an active exception", exit status -6) after its work succeeded. After a
    crash the group is left alone: destroying it would wait for collectives the other ranks never join.
    (``pretrain.py`` destroys its group itself, on every path, before it returns.)"""
    note_uncaught_exceptions()

    def destroy() -> None:
        if not ended_by_exception() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)
