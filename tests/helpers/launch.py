"""Starting the job scripts of the multi-process tests: torchrun on a free port, in a clean environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

_HANDED_OUT: set[int] = set()
ROOT = Path(__file__).resolve().parents[2]


def shipped_config(name: str) -> dict:
    """``configs/<name>`` as shipped, in fp32: its bf16 matmuls would crawl on a CPU without bf16 units, and what the
    multi-process tests check does not depend on the dtype."""
    config = json.loads((ROOT / "configs" / name).read_text())
    config["bf16"] = {"enabled": False}
    return config


def free_port() -> int:
    """A port no process listens on now, and one this process has not handed out before.

    The kernel may give the same free port to two binds in a row once the first socket is closed, so jobs started
    side by side (each reading its own ``free_port()`` before any of them listens) could collide without the record.
    """
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def torchrun(nproc: int, script: str | Path, *args: str) -> list[str]:
    """The command that starts ``script`` on ``nproc`` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            f"--master-port={free_port()}", str(script), *args]


def run(command: list[str], *, cwd: Path | None = None, timeout: int = 300,
        **env: str) -> subprocess.CompletedProcess:
    """Run ``command`` without the caller's rank variables, one OpenMP thread per process, plus ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    clean.update(OMP_NUM_THREADS="1", **env)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=clean, cwd=cwd)


def run_ok(command: list[str], **kwargs) -> str:
    """:func:`run`, which must succeed; returns stdout and stderr together."""
    result = run(command, **kwargs)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr
