"""benchmarks/gpu_session.sh — the script a lent GPU machine runs — keeps working without one: its stages run with
the plumbing the GPU will use (SIZE=tiny on the CPU), within its budget, and bring back only the files named. A
device call has minutes, not retries: whatever breaks (a missing package, the `transformers` reference, a cut), our
own figures must already be on disk."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_step
from tests.accelerator import skip_unless
from tests.launch import REPO_ROOT, env
from tests.progress import scaled

SCRIPT = str(REPO_ROOT / "benchmarks" / "gpu_session.sh")
ROW = "tiny fp32 recompute=0 max_tokens=512"


def _env(tmp_path, **extra):
    (tmp_path / "no-wheels").mkdir(exist_ok=True)  # the checkout's own .whl/ is not installed by a test
    return {
        **env(),
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "SIZE": "tiny",
        "TOKENS": "512",
        "STEPS": "1",
        "WHEELS": str(tmp_path / "no-wheels"),
        **extra,
    }


def _run(tmp_path, *stages, **extra):
    return subprocess.run(
        ["bash", SCRIPT, *stages], env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=scaled(600)
    )


def _broken_packages(tmp_path, **packages) -> str:
    """A folder that, first on PYTHONPATH, makes each named package fail to import as the GPU image's would."""
    root = tmp_path / "broken"
    for name, error in packages.items():
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"raise {error}\n")
    return f"{root}{os.pathsep}{env()['PYTHONPATH']}"


@pytest.mark.slow
@skip_unless("bf16")  # the stage measures bf16, as on the GPU; train.py refuses it where the CPU lacks it
def test_the_headline_stage_runs_ours_and_transformers_on_the_cpu(tmp_path):
    proc = _run(tmp_path, "headline")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "out" / "headline.json").read_text())
    assert (row["size"], row["precision"], row["max_tokens"], row["compile"]) == ("tiny", "bf16", 512, "none")
    assert row["tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
    assert "== headline: exit 0" in proc.stdout and "transformers on the same batches" in proc.stdout


@pytest.mark.slow
def test_without_datasets_and_with_a_broken_transformers_our_row_and_profile_still_come_back(tmp_path):
    """The GPU image has no `datasets` (no stage needs it) and the reference may fail: the env lines come first, our
    headline row, its profile and the reference's error are written — on old main the import gate exited 2 with OUT
    empty, and our row was only written after transformers' run."""
    pythonpath = _broken_packages(
        tmp_path,
        datasets="ModuleNotFoundError(\"No module named 'datasets'\", name='datasets')",
        transformers="ImportError('transformers is broken here (a test)')",
    )
    proc = _run(tmp_path, "headline", PRECISION="fp32", PYTHONPATH=pythonpath)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    (row,) = json.loads((out / "headline.json").read_text())
    assert row["tokens_per_s"] > 0 and row["loss"] > 0 and "error" not in row
    assert row["hf_error"] == "ImportError: transformers is broken here (a test)" and "hf_tokens_per_s" not in row
    assert json.loads((out / "profile" / "profile.json").read_text())["configuration"]["compile"] == "none"
    assert (out / "profile" / "trace.json.gz").stat().st_size > 0
    log = (out / "session.log").read_text().splitlines()
    assert log[0].startswith("env: ") and any(line.startswith("env: datasets missing") for line in log)
    assert sorted(os.listdir(out)) == ["headline.json", "profile", "session.log"]  # the data went to WORK


@pytest.mark.slow
def test_the_log_streams_so_a_call_cut_mid_stage_keeps_the_rows_already_printed(tmp_path):
    """Our row reaches session.log while its stage still runs (the profile and the reference come after it); the
    whole session is then killed, as a device call at its limit is, and the log keeps the row."""
    proc = subprocess.Popen(
        ["bash", SCRIPT, "headline"],
        env=_env(tmp_path, PRECISION="fp32", STEPS="2"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log, seen = tmp_path / "out" / "session.log", None
    try:
        deadline = time.monotonic() + scaled(300)
        while time.monotonic() < deadline and proc.poll() is None:
            text = log.read_text() if log.exists() else ""
            if ROW in text:
                seen = text
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert seen is not None, "our row never reached session.log while the stage ran"
    assert "== headline: exit" not in seen  # it came while the stage was running
    assert ROW in log.read_text()


def test_by_default_env_comes_first_and_then_headline_tier_quick_compile_within_300_s(tmp_path):
    proc = _run(tmp_path, BUDGET_S="5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    stages = [line.split()[1].rstrip(":") for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert stages == ["headline", "tier_quick", "compile", "done,"]
    assert proc.stdout.splitlines()[0].startswith("env: ")
    budget = next(line for line in Path(SCRIPT).read_text().splitlines() if line.startswith("BUDGET_S="))
    assert budget.strip() == "BUDGET_S=${BUDGET_S:-300}"


def test_a_stage_with_no_time_left_is_skipped_and_an_unknown_one_refused_before_any_runs(tmp_path):
    proc = _run(tmp_path, "headline", BUDGET_S="5")
    assert proc.returncode == 0 and "== headline: skipped" in proc.stdout
    proc = _run(tmp_path, "headline", "compiel")
    assert proc.returncode == 2 and "unknown stage compiel" in proc.stderr and "== headline" not in proc.stdout


def test_a_stage_whose_packages_are_missing_is_skipped_naming_them(tmp_path):
    pythonpath = _broken_packages(tmp_path, deepspeed="ModuleNotFoundError(\"No module named 'deepspeed'\")")
    proc = _run(tmp_path, "headline", PYTHONPATH=pythonpath)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "== headline: skipped, missing deepspeed (carry .whl from benchmarks/gpu_wheels.sh)" in proc.stdout
    assert "env: deepspeed missing" in (tmp_path / "out" / "session.log").read_text()


def test_the_headline_model_has_the_recipes_vocabulary():
    recipe = json.loads(
        (REPO_ROOT / "recipes" / "transformer-big-wmt14-en-fr" / "transformer-big-wmt14-en-fr.json").read_text()
    )
    big = [str(f) for f in gpu_step.SIZES["big"]]
    assert big[big.index("--vocab_size") + 1] == str(recipe["model"]["vocab_size"]) == "32000"


@pytest.mark.parametrize(
    "message, lost",
    [
        ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", False),
        ("CUDA error: out of memory", False),
        ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", False),
        ("CUDA error: an illegal memory access was encountered", True),
        ("CUDA error: unspecified launch failure", True),
    ],
)
def test_an_allocation_failure_is_not_a_lost_device(message, lost):
    assert gpu_step._device_lost(RuntimeError(message)) is lost


def test_gpu_wheels_on_a_python_without_the_packages_leaves_the_wheels_that_were_there(tmp_path):
    """gpu_wheels.sh checks its Python before it touches .whl/ (old main emptied it first, then failed)."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "benchmarks" / "gpu_wheels.sh", repo / "benchmarks")
    (repo / ".whl").mkdir()
    (repo / ".whl" / "kept-1.0-py3-none-any.whl").write_text("a wheel made earlier")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # -S: no site-packages
    (shim / "python3").chmod(0o755)
    proc = subprocess.run(
        ["bash", str(repo / "benchmarks" / "gpu_wheels.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"},
        timeout=scaled(120),
    )
    assert proc.returncode == 2 and "has no deepspeed" in proc.stderr, proc.stderr
    assert os.listdir(repo / ".whl") == ["kept-1.0-py3-none-any.whl"]
    assert sorted(os.listdir(repo)) == [".whl", "benchmarks"]  # no staging folder left
