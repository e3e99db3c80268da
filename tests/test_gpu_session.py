"""benchmarks/gpu_session.sh — the script a lent GPU machine runs — keeps working without one: its stages run with
the plumbing the GPU will use (SIZE=tiny on the CPU), within its budget, and bring back only the files named."""
import json
import os
import subprocess

import pytest

from tests.accelerator import skip_unless
from tests.launch import REPO_ROOT, env

SCRIPT = str(REPO_ROOT / "benchmarks" / "gpu_session.sh")


def _run(tmp_path, *stages, **extra):
    e = {**env(), "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "SIZE": "tiny", "TOKENS": "512",
         "STEPS": "1", **extra}
    return subprocess.run(["bash", SCRIPT, *stages], env=e, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@skip_unless("bf16")     # the stage measures bf16, as on the GPU; train.py refuses it where the CPU lacks it
def test_the_headline_stage_runs_ours_and_transformers_on_the_cpu(tmp_path):
    proc = _run(tmp_path, "env", "headline")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "out" / "headline.json").read_text())
    assert (row["size"], row["precision"], row["max_tokens"], row["compile"]) == ("tiny", "bf16", 512, "none")
    assert row["tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
    assert "== headline: exit 0" in proc.stdout and "transformers on the same batches" in proc.stdout
    assert "torch" in (tmp_path / "out" / "session.log").read_text()
    assert sorted(os.listdir(tmp_path / "out")) == ["headline.json", "session.log"]    # the data went to WORK


def test_a_stage_with_no_time_left_is_skipped_and_an_unknown_one_refused_before_any_runs(tmp_path):
    proc = _run(tmp_path, "headline", BUDGET_S="5")
    assert proc.returncode == 0 and "== headline: skipped" in proc.stdout
    proc = _run(tmp_path, "headline", "compiel")
    assert proc.returncode == 2 and "unknown stage compiel" in proc.stderr and "== headline" not in proc.stdout
