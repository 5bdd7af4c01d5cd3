"""Starting the job scripts of the multi-process tests: torchrun on a free port, in a clean environment."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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


def beside_deepspeed(job: Path, root: Path, *args: str, per_backend_dir: bool = False, one_thread: bool = True,
                     timeout: int = 300) -> dict[str, dict]:
    """Run ``job BACKEND ROOT/BACKEND.json [ROOT/BACKEND] *args`` as real DeepSpeed (``deepspeed``) and as this engine
    (``angelptm``) at once, one CPU process each, and return the JSON each wrote, by backend.

    Each process imports the checkout under test (``PYTHONPATH``), not an installed copy, and sees no GPU and none
    of the caller's rank variables; DeepSpeed's gets a one-rank launcher environment (else it tries MPI discovery).
    ``per_backend_dir``: each gets a directory of its own, passed after its JSON path; ``one_thread``: one OpenMP
    thread each (both at once on a small machine)."""
    base = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if one_thread:
        base["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        base.pop(name, None)
    launcher = {"DS_ACCELERATOR": "cpu", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    running = {}
    for backend, env in (("deepspeed", {**base, **launcher}), ("angelptm", base)):
        own_dir = [str(root / backend)] if per_backend_dir else []
        if per_backend_dir:
            (root / backend).mkdir()
        running[backend] = subprocess.Popen([sys.executable, str(job), backend, str(root / f"{backend}.json"),
                                             *own_dir, *args], env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
    out = {}
    for backend, process in running.items():
        log, _ = process.communicate(timeout=timeout)
        assert process.returncode == 0, f"{backend} job failed:\n{log[-4000:]}"
        out[backend] = json.loads((root / f"{backend}.json").read_text())
    return out


def load_script(relative_path: str) -> ModuleType:
    """A script of the checkout (``bench/…``, ``tools/…``: not packages) imported as a module named after its file,
    registered in ``sys.modules`` first (its dataclasses look their module up there while they are built)."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
