"""accelerate's DeepSpeed path on this engine (``import angelptm.integrations.accelerate``) against real DeepSpeed.

Both backends run ``tests/helpers/accelerate_job.py`` (an ``Accelerator`` script using the API calls of
accelerate's ``deepspeed_with_config_support.py`` example) at the same time, each in a process of its own with
a one-rank launcher environment, as ``accelerate launch`` gives it: CPU, fp32, a tiny GPT-2, ZeRO-2 and ZeRO-3
with params and optimizer offloaded. The alias itself is checked in subprocesses: it is process-wide.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from accelerate_job import CASES, SAVE_AFTER, STEPS  # noqa: E402  (tests/helpers, after the skips)

from angelptm.config import load_config  # noqa: E402
from angelptm.config.edge import NEVER_STEPS  # noqa: E402
from angelptm.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "accelerate_job.py"


def _env(**extra: str) -> dict[str, str]:
    # PYTHONPATH: the jobs import the checkout under test, not whichever copy of angelptm is installed.
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), **extra}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("accelerate")
    running = {}
    for offset, backend in enumerate(("deepspeed", "angelptm")):
        launcher = {"DS_ACCELERATOR": "cpu", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(31000 + offset + 2 * (os.getpid() % 900))}
        (root / backend).mkdir()
        running[backend] = subprocess.Popen([sys.executable, str(JOB), backend, str(root / f"{backend}.json"),
                                             str(root / backend)], env=_env(**launcher), stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
    out = {"root": root}
    for backend, process in running.items():
        log, _ = process.communicate(timeout=400)
        assert process.returncode == 0, f"{backend} job failed:\n{log[-4000:]}"
        out[backend] = json.loads((root / f"{backend}.json").read_text())
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_and_grad_norms_equal_deepspeeds_per_step(results, case) -> None:
    ours, theirs = results["angelptm"][case], results["deepspeed"][case]
    assert len(ours["losses"]) == len(theirs["losses"]) == STEPS
    assert theirs["losses"][-1] < theirs["losses"][0] - 0.05, "the model must learn, or agreement proves little"
    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) <= 1e-5, (ours, theirs)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours["norms"], theirs["norms"])), (ours, theirs)
    assert ours["eval"] == pytest.approx(theirs["eval"], abs=1e-5)
    assert ours["unwrapped"] == theirs["unwrapped"] == "GPT2LMHeadModel"  # unwrap_model found the module


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_state_resumes_where_save_state_left_off(results, case) -> None:
    ours = results["angelptm"][case]
    assert len(ours["resumed"]) == STEPS - SAVE_AFTER
    # The steps after load_state repeat the ones after save_state: weights, optimizer and schedule came back.
    assert max(abs(a - b) for a, b in zip(ours["resumed"], ours["losses"][SAVE_AFTER:])) <= 1e-6


@pytest.mark.parametrize("case", sorted(CASES))
def test_saved_model_reloads_with_from_pretrained(results, case) -> None:
    import transformers

    work = results["root"] / "angelptm" / case
    state = torch.load(work / "state.pt", weights_only=True)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(work / "model").state_dict()
    assert set(state) <= set(reloaded)
    for key, value in state.items():
        torch.testing.assert_close(reloaded[key], value, rtol=0, atol=0)
    initial = transformers.AutoModelForCausalLM.from_pretrained(results["root"] / "angelptm" / "init").state_dict()
    assert any(not torch.equal(initial[key], value) for key, value in state.items())  # trained weights were saved


def test_steps_per_print_infinity_means_never_and_other_non_finite_values_stay_refused() -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("inf")})
    assert config.monitor.steps_per_print == NEVER_STEPS
    with pytest.raises(ConfigError, match="steps_per_print: -Infinity is not a usable value"):
        load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("-inf")})
    with pytest.raises(ConfigError, match="gradient_clipping: Infinity is not a usable value"):
        load_config({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": float("inf")})


ALIAS_CHECK = """
import importlib, sys
import angelptm.integrations.accelerate
import angelptm, deepspeed
from deepspeed import DeepSpeedEngine
import deepspeed.runtime.zero.partition_parameters as pp
assert deepspeed is angelptm and DeepSpeedEngine is angelptm.Engine
assert pp is sys.modules["angelptm.runtime.zero.partition_parameters"]
try:
    import deepspeed.inference
except ImportError as err:
    print("missing:", err)
"""

REAL_FIRST = """
import deepspeed
import angelptm.integrations.accelerate
"""


def test_alias_gives_angelptms_own_modules_and_names_what_it_lacks() -> None:
    done = subprocess.run([sys.executable, "-c", ALIAS_CHECK], env=_env(DS_ACCELERATOR="cpu"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "missing: deepspeed.inference is not provided by angelptm" in done.stdout
    done = subprocess.run([sys.executable, "-c", REAL_FIRST], env=_env(DS_ACCELERATOR="cpu"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "the real DeepSpeed was imported before angelptm.integrations" in done.stderr


REAL_FOR_A_BLOCK = """
import angelptm.integrations.accelerate
import angelptm
from angelptm.integrations.deepspeed_alias import suspended
with suspended():
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    assert deepspeed is not angelptm and deepspeed.__file__.endswith("deepspeed/__init__.py"), deepspeed
    assert DeepSpeedCPUAdam.__module__ == "deepspeed.ops.adam.cpu_adam", DeepSpeedCPUAdam.__module__
real_class = DeepSpeedCPUAdam
import deepspeed
from deepspeed.ops.adam import DeepSpeedCPUAdam
assert deepspeed is angelptm and DeepSpeedCPUAdam.__module__ == "angelptm.ops.adam", DeepSpeedCPUAdam.__module__
with suspended():  # a second engine's host Adam: the same real class, so its optimizer ids go on counting
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    assert DeepSpeedCPUAdam is real_class
import sys
assert sys.modules["deepspeed"] is angelptm and type(sys.meta_path[0]).__name__ == "_AliasFinder", sys.meta_path
print("ok")
"""


def test_host_adam_reaches_the_real_deepspeed_op_under_the_alias_and_the_alias_comes_back() -> None:
    # Lightning's ZeRO-3 offload under the switch died at attach: ZeRO-Cache's host Adam imported the alias's
    # torch-backed DeepSpeedCPUAdam, which has no C++ op to hand over.
    done = subprocess.run([sys.executable, "-c", REAL_FOR_A_BLOCK], env=_env(DS_ACCELERATOR="cpu"),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_engine_hands_zero_cache_the_alias_suspension_for_its_host_adam(monkeypatch) -> None:
    """ZeRO-Cache knows nothing of angelptm's alias: the engine passes the context its host Adam imports DeepSpeed
    in, and HostAdam imports inside it (here the context refuses, so no op is built, and the host Adam falls back)."""
    from test_zero_cache_device_steps import tiny_llama
    from test_zero_cache_streamed import config

    import angelptm
    from angelptm.engine import builders
    from angelptm.integrations import deepspeed_alias
    from zero_cache.optim.host_adam import HostAdam

    handed = []
    attach = builders.zero_cache.attach

    def recording_attach(*args, **kwargs):
        handed.append(kwargs)
        return attach(*args, **kwargs)

    monkeypatch.setattr(builders.zero_cache, "attach", recording_attach)
    angelptm.initialize(model=tiny_llama(0), config=config("host"))
    assert [kwargs["deepspeed_import"] for kwargs in handed] == [deepspeed_alias.suspended]
    entered = []

    @contextlib.contextmanager
    def refusing():
        entered.append(True)
        raise ImportError("refused by the test")
        yield

    assert HostAdam(True, try_deepspeed=True, deepspeed_import=refusing).name == "torch fused CPU Adam"
    assert entered == [True]
