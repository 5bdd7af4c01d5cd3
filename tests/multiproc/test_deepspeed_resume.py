"""A run started on real DeepSpeed 0.19.8 goes on here with the losses DeepSpeed's own resume gives (CPU, gloo, fp32).

For each ZeRO stage and rank count, ``tests/helpers/ds_resume_job.py`` trains a tiny GPT (tied embeddings, AdamW,
a warmup still moving the lr, clipping, 2 micro-batches per step) for FIRST steps on DeepSpeed and saves; then
DeepSpeed's ``load_checkpoint`` and this engine's, each into a model built from another seed, train the next STEPS
steps on the same batches. The losses must agree per micro-step (they agree exactly on this machine; TOL is the
1e-6 relative the project compares the engines' fp32 steps with), and so must the lrs, the counters and the
script's ``client_state``. ZeRO-Cache resumes the same way (states on the host tier, params streamed or sharded).
``zero_to_fp32`` reads the weights DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` reads, exactly.

The other way round, DeepSpeed's ``load_checkpoint`` on one of ours stops with the bare ``AssertionError``
docs/deepspeed-compatibility.md names, and the way that page and ``angelptm-export``'s hint give works: DeepSpeed
trains on from the exported weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from launch import ROOT, run, torchrun

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.dist

from ds_resume_job import CLIENT_STATE  # noqa: E402  (tests/helpers, after the skip)

from angelptm.checkpoints import export  # noqa: E402
from angelptm.utils import zero_to_fp32  # noqa: E402

JOB = ROOT / "tests" / "helpers" / "ds_resume_job.py"
FIRST, STEPS = 3, 3
TOL = 1e-6
CASES = [(1, 0, "fp32"), (1, 1, "fp32"), (1, 2, "fp32"), (1, 3, "fp32"), (2, 0, "fp32"), (2, 2, "fp32"), (2, 3, "fp32"),
         (1, 0, "bf16"), (1, 2, "bf16")]
"""(ranks, ZeRO stage, precision). Stage 1 saves what stage 2 does (on two ranks, stage 2's code path reads it). bf16
saves other files: DeepSpeed's bf16 optimizer at stage 0 (a master per parameter), ``bf16_zero_pp_rank_*`` at 2."""
ZERO_CACHE_CASES = {(1, 2, "fp32"): ("host",), (1, 3, "fp32"): ("streamed",), (2, 3, "fp32"): ("host", "sharded")}
"""ZeRO-Cache's resumes (``ds_resume_job.ZERO_CACHE``): optimizer states on the host tier, params streamed from the
host, params sharded over the ranks."""
BF16_TOL = 1e-3
"""bf16: the engines' own steps differ in rounding (DeepSpeed accumulates bf16 gradients in bf16, this engine in fp32),
so after the first optimizer step the losses agree to bf16's precision only; before it they are equal."""
ENV = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
       "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def start(world: int, backend: str, stage: int, save_dir: Path, out: Path, *extra: str,
          precision: str = "fp32") -> subprocess.Popen:
    command = torchrun(world, JOB, "--backend", backend, "--stage", str(stage), "--save-dir", str(save_dir),
                       "--first", str(FIRST), "--steps", str(STEPS), "--out", str(out), *extra,
                       *(["--bf16"] if precision == "bf16" else []))
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen(command, env={**clean, "OMP_NUM_THREADS": "1", **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, what: str) -> str:
    log, _ = process.communicate(timeout=300)
    assert process.returncode == 0, f"{what} failed:\n{log[-4000:]}"
    return log


@pytest.fixture(scope="module")
def deepspeed_checkpoint(tmp_path_factory):
    """``(ranks, stage, precision) -> (save_dir, DeepSpeed's weights)``: DeepSpeed trains FIRST steps and saves."""
    saved: dict[tuple[int, int, str], tuple[Path, dict[str, torch.Tensor]]] = {}

    def make(world: int, stage: int, precision: str = "fp32") -> tuple[Path, dict[str, torch.Tensor]]:
        if (world, stage, precision) not in saved:
            work = tmp_path_factory.mktemp(f"ds_w{world}_s{stage}_{precision}")
            finish(start(world, "deepspeed", stage, work / "saved", work / "first.json", precision=precision),
                   "DeepSpeed's first steps")
            saved[world, stage, precision] = work / "saved", torch.load(work / "first.pt")
        return saved[world, stage, precision]

    return make


@pytest.fixture(scope="module", params=CASES, ids=[f"{w}rank-stage{s}-{p}" for w, s, p in CASES])
def resumed(request, deepspeed_checkpoint, tmp_path_factory) -> dict:
    """DeepSpeed's resume and ours (and ZeRO-Cache's) of one case, side by side."""
    world, stage, precision = request.param
    save_dir, weights = deepspeed_checkpoint(world, stage, precision)
    work = tmp_path_factory.mktemp(f"resume_w{world}_s{stage}_{precision}")
    runs = {"deepspeed": (), "angelptm": ()}
    runs.update({f"zero_cache_{name}": ("--zero-cache", name) for name in ZERO_CACHE_CASES.get(request.param, ())})
    processes = {name: start(world, "deepspeed" if name == "deepspeed" else "angelptm", stage, save_dir,
                             work / f"{name}.json", "--load", *extra, precision=precision)
                 for name, extra in runs.items()}
    results = {name: (finish(process, f"{name}'s resume"), json.loads((work / f"{name}.json").read_text()))[1]
               for name, process in processes.items()}
    return {"precision": precision, "save_dir": save_dir, "weights": weights, **results}


def relative_difference(ours: list[float], reference: list[float]) -> float:
    assert len(ours) == len(reference)
    return max(abs(a - b) / abs(b) for a, b in zip(ours, reference))


def test_load_checkpoint_of_a_deepspeed_checkpoint_trains_on_with_deepspeeds_losses(resumed):
    reference = resumed["deepspeed"]
    for name in [n for n in resumed if n == "angelptm" or n.startswith("zero_cache_")]:
        ours = resumed[name]
        assert len(ours["losses"]) == STEPS * 2
        assert relative_difference(ours["losses"][:2], reference["losses"][:2]) <= TOL, (name, ours["losses"],
                                                                                           reference["losses"])
        tolerance = BF16_TOL if resumed["precision"] == "bf16" else TOL
        assert relative_difference(ours["losses"], reference["losses"]) <= tolerance, (name, ours["losses"],
                                                                                         reference["losses"])
        # DeepSpeed's get_lr() after a load is its optimizer's lr, which the load restored: ours too
        assert ours["lrs"] == pytest.approx(reference["lrs"], rel=1e-12), name
        for key in ("global_steps", "global_samples", "skipped_steps"):
            assert ours[key] == reference[key], (name, key)
        assert ours["client_state"] == reference["client_state"] == CLIENT_STATE
        assert ours["other_keys"] == [], "DeepSpeed's own entries are not the script's client_state"
        assert Path(ours["path"]) == resumed["save_dir"] / f"global_step{FIRST}"
    assert len(set(reference["lrs"])) > 2, "the warmup must move the lr, or equal lrs prove little"


def test_zero_to_fp32_reads_the_weights_deepspeed_reads(resumed, tmp_path):
    ours = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(resumed["save_dir"])
    # stages 1-3: DeepSpeed's own zero_to_fp32; stage 0 (which that does not read): DeepSpeed's module, in bf16 its
    # bf16 weights (the fp32 masters of stage 0 are kept by position, which only the resuming optimizer names)
    reference = resumed["weights"]
    assert list(ours) == list(reference)
    for key, tensor in reference.items():
        assert torch.equal(ours[key], tensor.float()), key
    assert zero_to_fp32.main([str(resumed["save_dir"]), str(tmp_path / "out"), "--safe_serialization"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def copy_checkpoint(deepspeed_checkpoint, tmp_path: Path, world: int, stage: int) -> Path:
    save_dir, _ = deepspeed_checkpoint(world, stage)
    return Path(shutil.copytree(save_dir, tmp_path / "copy"))


def test_a_deepspeed_checkpoint_missing_a_ranks_file_is_refused_naming_the_format(deepspeed_checkpoint, tmp_path,
                                                                                 capsys):
    copy = copy_checkpoint(deepspeed_checkpoint, tmp_path, 2, 2)
    (copy / f"global_step{FIRST}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert zero_to_fp32.main([str(copy), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert "is a DeepSpeed checkpoint" in error and "saved by 2 ranks" in error and "ranks [0]" in error
    assert "Copy the whole checkpoint directory again" in error


def test_layouts_not_read_are_refused_naming_the_format(deepspeed_checkpoint, tmp_path, capsys):
    copy = copy_checkpoint(deepspeed_checkpoint, tmp_path, 1, 2)
    tag_dir = copy / f"global_step{FIRST}"
    shutil.copy(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "mp_rank_01_model_states.pt")
    assert export.main([str(copy), str(tmp_path / "w.safetensors")]) == 1
    error = capsys.readouterr().err
    assert "is a DeepSpeed checkpoint, and a tensor-parallel one, which this engine does not read" in error
    assert "zero_to_fp32.py" in error


def test_a_deepspeed_file_naming_a_callable_is_refused_and_nothing_in_it_runs(deepspeed_checkpoint, tmp_path,
                                                                             capsys):
    copy = copy_checkpoint(deepspeed_checkpoint, tmp_path, 1, 2)
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save({"optimizer_state_dict": Hostile()},
               copy / f"global_step{FIRST}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert zero_to_fp32.main([str(copy), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert "is a DeepSpeed checkpoint" in error and "posix.system" in error
    assert not marker.exists()


def test_deepspeed_loading_ours_fails_as_documented_and_the_exported_weights_go_on_there(tmp_path, capsys):
    ours_dir = tmp_path / "ours"
    finish(start(1, "angelptm", 2, ours_dir, tmp_path / "first.json"), "angelptm's first steps")
    resumed = start(1, "angelptm", 2, ours_dir, tmp_path / "resumed.json", "--load")
    refused = run(torchrun(1, JOB, "--backend", "deepspeed", "--stage", "2", "--save-dir", str(ours_dir), "--first",
                           str(FIRST), "--steps", "1", "--out", str(tmp_path / "refused.json"), "--load"), **ENV)
    assert refused.returncode != 0
    assert "AssertionError" in refused.stderr and "state_dict_factory.py" in refused.stderr  # the docs' words
    docs = (ROOT / "docs" / "deepspeed-compatibility.md").read_text()
    assert "state_dict_factory.py" in docs and "angelptm-export" in docs

    assert export.main([str(ours_dir), str(tmp_path / "w.safetensors")]) == 0
    hint = capsys.readouterr().out
    assert "before deepspeed.initialize()" in hint and "does not read angelptm checkpoints" in hint
    finish(start(1, "deepspeed", 2, ours_dir, tmp_path / "deepspeed.json", "--init-from",
                 str(tmp_path / "w.safetensors")), "DeepSpeed from the exported weights")
    finish(resumed, "angelptm's resume")
    ours = json.loads((tmp_path / "resumed.json").read_text())["losses"]
    theirs = json.loads((tmp_path / "deepspeed.json").read_text())["losses"]
    # The same weights: the same losses up to the first optimizer step (2 micro-batches), whose Adam starts afresh.
    assert relative_difference(theirs[:2], ours[:2]) <= TOL, (theirs, ours)
