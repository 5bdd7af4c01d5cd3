"""Run DeepSpeed's own unit tests of its public config and scheduler API against angelptm and against DeepSpeed.

    python bench/deepspeed_api_tests.py --deepspeed-src /path/to/DeepSpeed [--out DIR] [--backend both]

``--deepspeed-src`` is a DeepSpeed source tree (a checkout, or a bare git directory such as the one the
``fetch`` tool makes: its ``tests/`` are taken from HEAD with ``git archive``). Nothing of DeepSpeed's is
copied into this repository: the tests are copied into a temporary directory per run.

For the angelptm run, a ``sitecustomize.py`` written into that directory (on ``PYTHONPATH``, so the worker
processes DeepSpeed's ``DistributedTest`` starts get it too) installs
:mod:`angelptm.integrations.deepspeed_alias` before anything runs: every ``import deepspeed`` in the tests
and their helpers is angelptm. Both runs' ``sitecustomize.py`` also keep a failing distributed test from
hanging DeepSpeed's worker pool (``POOL_FIX``). The DeepSpeed run uses the installed ``deepspeed`` with
``DS_ACCELERATOR=cpu``.
Both runs write JUnit XML; the script prints each backend's pass count and the tests that pass under
DeepSpeed but not here (write them to ``--out``/``differences.txt``).

Takes long on CPU (each distributed test starts its own worker pool: about 30 minutes per backend on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_FILES = ("unit/runtime/test_ds_config_dict.py", "unit/runtime/test_ds_config_model.py",
              "unit/runtime/test_ds_initialize.py", "unit/runtime/test_lr_schedulers.py",
              "unit/runtime/test_precision_config_dynamic_scale.py", "unit/runtime/test_precision_config_loss_scale.py",
              "unit/runtime/zero/test_zero_config.py", "unit/runtime/test_runtime_utils.py")
"""DeepSpeed's tests of ``runtime.config``, ``config_utils``, ``zero.config``, ``precision_config``,
``lr_schedules``, ``initialize`` and ``runtime.utils``."""

POOL_FIX = """# Written by angelptm's bench/deepspeed_api_tests.py, for both backends alike.
# DeepSpeed's DistributedTest re-raises a failed test's exception in a multiprocessing.Pool worker; pytest's
# outcome exceptions (a failed pytest.raises) are BaseExceptions, which the worker does not catch: it dies and the
# pool waits until DeepSpeed's harness ends the whole session ("Test hanged"). Turned into a RuntimeError, the failure
# is reported as one and the run goes on.
import multiprocessing.pool as _pool

_starmapstar = _pool.starmapstar


def starmapstar(args):
    try:
        return _starmapstar(args)
    except (Exception, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        raise RuntimeError(f"{type(err).__name__}: {err}") from None


starmapstar.__module__ = "multiprocessing.pool"  # pickled by that name into workers, which patch it too
_pool.starmapstar = starmapstar
"""

ALIAS = """# `deepspeed` is angelptm in every process of this run.
import angelptm.integrations.deepspeed_alias as _alias
_alias.install()
"""

PYTEST_INI = """[pytest]
markers =
    sequential: DeepSpeed's marker
    world_size: DeepSpeed's marker
    nightly: DeepSpeed's marker
"""


def copy_tests(source: Path, into: Path) -> Path:
    """DeepSpeed's ``tests/`` under ``into`` (from a work tree, or from HEAD of a bare git directory)."""
    if (source / "tests" / "unit").is_dir():
        shutil.copytree(source / "tests", into / "tests")
    else:
        archive = subprocess.run(["git", "--git-dir", str(source), "archive", "HEAD", "tests"], capture_output=True,
                                 check=False)
        if not archive.stdout:
            raise SystemExit(f"{source}: neither a DeepSpeed checkout nor a git directory with tests/ at HEAD "
                             f"({archive.stderr.decode()[-300:]})")
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    (into / "tests" / "pytest.ini").write_text(PYTEST_INI)  # DeepSpeed's addopts deselect by markers we do not need
    return into / "tests"


def run_backend(backend: str, tests: Path, out: Path, timeout_s: int) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    site_dir = tests.parent / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(POOL_FIX + (ALIAS if backend == "angelptm" else ""))
    env["PYTHONPATH"] = os.pathsep.join([str(site_dir), *([str(ROOT)] if backend == "angelptm" else []),
                                         *filter(None, [env.get("PYTHONPATH")])])
    command = ["timeout", str(timeout_s), sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN",
               "--continue-on-collection-errors",
               f"--junitxml={out / f'{backend}.xml'}", *TEST_FILES]
    log = open(out / f"{backend}.log", "w")
    return subprocess.Popen(command, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT)


def outcomes(xml_path: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from a JUnit XML file (collection errors count as errors)."""
    if not xml_path.exists():
        return {}
    result = {}
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        result[test_id] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return result


def report(results: dict[str, dict[str, str]], out: Path) -> None:
    for backend, by_test in results.items():
        counts = {kind: sum(1 for value in by_test.values() if value == kind)
                  for kind in ("passed", "failed", "error", "skipped")}
        print(f"{backend}: {counts['passed']} passed of {len(by_test)} ({counts['failed']} failed, "
              f"{counts['error']} errors, {counts['skipped']} skipped)")
    if set(results) == {"angelptm", "deepspeed"}:
        theirs, ours = results["deepspeed"], results["angelptm"]
        missing = sorted(test for test, kind in theirs.items() if kind == "passed" and ours.get(test) != "passed")
        both = sum(1 for test, kind in theirs.items() if kind == "passed" and ours.get(test) == "passed")
        print(f"passing under DeepSpeed: {sum(k == 'passed' for k in theirs.values())}; of those, passing on "
              f"angelptm: {both}; not: {len(missing)} (listed in {out / 'differences.txt'})")
        (out / "differences.txt").write_text("".join(f"{ours.get(test, 'absent')}\t{test}\n" for test in missing))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-src", type=Path, required=True, help="DeepSpeed checkout or bare git directory")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "deepspeed_api")
    parser.add_argument("--backend", choices=("both", "angelptm", "deepspeed"), default="both")
    parser.add_argument("--timeout-s", type=int, default=7200, help="per backend")
    args = parser.parse_args()
    args.out = args.out.resolve()  # pytest runs in the copied tests' directory
    args.out.mkdir(parents=True, exist_ok=True)
    backends = ("angelptm", "deepspeed") if args.backend == "both" else (args.backend,)
    with tempfile.TemporaryDirectory(prefix="ds_api_tests_") as temp:
        running = {}
        for backend in backends:  # a copy each: the runs write files beside the tests
            (Path(temp) / backend).mkdir()
            tests = copy_tests(args.deepspeed_src, Path(temp) / backend)
            running[backend] = run_backend(backend, tests, args.out, args.timeout_s)
        for process in running.values():
            process.wait()
    report({backend: outcomes(args.out / f"{backend}.xml") for backend in backends}, args.out)


if __name__ == "__main__":
    main()
