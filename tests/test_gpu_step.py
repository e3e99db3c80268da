"""benchmarks/gpu_step.py keeps working without a GPU: --help, and its tiny configuration on CPU (2 token-batch
sizes, train.py's engine on Multi30k, and `transformers`' reference on the same batches), with the figures it
reports."""

import json
import sys

import pytest

from tests.launch import REPO_ROOT, env, run_python

SCRIPT = str(REPO_ROOT / "benchmarks" / "gpu_step.py")


def test_help_starts_nothing():
    proc = run_python([sys.executable, SCRIPT, "--help"], env=env(), timeout=60)
    assert proc.returncode == 0 and "--device_peak" in proc.stdout and "transformer-big" in proc.stdout


@pytest.mark.slow
def test_tiny_configuration_on_cpu(multi30k_tsv, bpe_tokenizer, tmp_path):
    out = tmp_path / "step.json"
    proc = run_python(
        [
            sys.executable,
            SCRIPT,
            "--file_path",
            str(multi30k_tsv),
            "--tokenizer",
            str(bpe_tokenizer),
            "--workdir",
            str(tmp_path / "work"),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--device_peak",
            "H100",
            "--hf",
            "--json",
            str(out),
        ],
        env=env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["size"], r["precision"], r["max_tokens"]) for r in rows] == [
        ("tiny", "fp32", 512),
        ("tiny", "fp32", 1024),
    ]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["peak_mem_mib"] > 0 and r["device"] == "cpu"
        assert r["peak_device"] == "H100" and 0 < r["mfu"] < 1  # against the named peak only
        assert r["hf_tokens_per_s"] > 0 and r["speedup_vs_hf"] == r["tokens_per_s"] / r["hf_tokens_per_s"]
    assert "MFU" in proc.stdout and "transformers on the same batches" in proc.stdout


def test_an_unknown_device_peak_is_one_line(multi30k_tsv, bpe_tokenizer, tmp_path):
    proc = run_python(
        [
            sys.executable,
            SCRIPT,
            "--file_path",
            str(multi30k_tsv),
            "--tokenizer",
            str(bpe_tokenizer),
            "--workdir",
            str(tmp_path / "work"),
            "--steps",
            "1",
            "--warmup",
            "0",
            "--max_tokens",
            "512",
            "--device_peak",
            "TPUv9",
        ],
        env=env(),
        timeout=600,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --device_peak TPUv9: no fp32 peak known")


@pytest.mark.slow
def test_compiled_variant_and_profile_of_the_first(multi30k_tsv, bpe_tokenizer, tmp_path):
    """--compile default trains the same model on the same batches as eager — with recompute and dropout, where the
    recomputation must draw the forward's dropout masks again (inductor's own random numbers would not): the losses
    agree to rounding — and --profile writes the first configuration's trace (eager: the headline a GPU session
    profiles before anything else can fail) and where its step's time went."""
    out, prof = tmp_path / "step.json", tmp_path / "profile"
    proc = run_python(
        [
            sys.executable,
            SCRIPT,
            "--file_path",
            str(multi30k_tsv),
            "--tokenizer",
            str(bpe_tokenizer),
            "--workdir",
            str(tmp_path / "work"),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--max_tokens",
            "512",
            "--recompute",
            "1",
            "--compile",
            "none",
            "default",
            "--profile",
            str(prof),
            "--profile_steps",
            "2",
            "--json",
            str(out),
        ],
        env={**env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
        timeout=900,
    )  # cold, as CI
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    eager, compiled = json.loads(out.read_text())
    assert (eager["compile"], compiled["compile"]) == ("none", "default") and eager["recompute"]
    assert "error" not in compiled and compiled["tokens_per_s"] > 0
    assert abs(compiled["loss"] - eager["loss"]) <= 1e-5 * eager["loss"], (eager["loss"], compiled["loss"])
    summary = json.loads((prof / "profile.json").read_text())
    assert summary["configuration"]["compile"] == "none" and summary["steps"] == 2
    assert summary["host_ops_ms_by_kind"]["matmul"] > 0 and (prof / "trace.json").stat().st_size > 0
    assert "profile of {'size': 'tiny'" in proc.stdout and "host operators' own time" in proc.stdout


def _fake_row(loss=1.0):
    return {
        "median_step_s": 0.1,
        "tokens_per_s": 10.0,
        "target_tokens_per_s": 5.0,
        "tflops": 1.0,
        "mfu": None,
        "peak_device": None,
        "peak_mem_mib": 1.0,
        "device": "cpu",
        "loss": loss,
    }


@pytest.mark.parametrize(
    "failure, lost",
    [
        (AssertionError("cudagraph trees: current_node is None"), False),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    ],
    ids=["assertion", "device-lost"],
)
def test_a_failing_variant_is_a_row(failure, lost, monkeypatch, multi30k_tsv, bpe_tokenizer, tmp_path, capsys):
    """A variant that raises is recorded as an error row and the JSON (rewritten after every row) keeps the others;
    after a CUDA error that leaves the device unusable the remaining variants are not run, and the exit code says so."""
    import benchmarks.gpu_step as gpu_step

    ran = []

    def fake_measure(runner, *args, **kwargs):  # build (faked too) hands the mode on as the runner
        ran.append(runner)
        if runner == "reduce-overhead":
            raise failure
        return _fake_row()

    monkeypatch.setattr(gpu_step, "build", lambda flags, mode: mode)
    monkeypatch.setattr(gpu_step, "measure", fake_measure)
    out = tmp_path / "rows.json"
    rc = gpu_step.main(
        [
            "--file_path",
            str(multi30k_tsv),
            "--tokenizer",
            str(bpe_tokenizer),
            "--workdir",
            str(tmp_path / "work"),
            "--max_tokens",
            "512",
            "--compile",
            "none",
            "reduce-overhead",
            "default",
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())
    assert [r["compile"] for r in rows] == ["none", "reduce-overhead", "default"]
    assert "error" not in rows[0] and rows[1]["error"].startswith(type(failure).__name__)
    assert ran == (["none", "reduce-overhead"] if lost else ["none", "reduce-overhead", "default"])
    assert ("not run: the device was lost" in rows[2]["error"]) if lost else "error" not in rows[2]
    assert rc == (1 if lost else 0)
    assert "failed —" in capsys.readouterr().out
