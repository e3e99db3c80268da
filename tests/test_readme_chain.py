"""The README's Prepare → Train → Translate commands, run as written: Train uses the tokenizer and lengths Prepare
made (it finds the prepared token store instead of building another) and saves a checkpoint, and Translate reads
it. Run in a scratch folder holding links to data/ and run_scripts/, so `out/` lands there, not in the checkout."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def _commands(block: str) -> list[str]:
    """A bash block's commands: comments dropped, backslash continuations joined."""
    text = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _blocks(title: str) -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_prepare_train_translate_chain(tmp_path):
    prepare, train = _blocks("Train on your own data")[:2]
    translate = _blocks("Translate, evaluate, average, export to transformers")[0]
    one_process = [c for c in _commands(train) if not c.startswith("deepspeed")]
    chain = _commands(prepare) + one_process[:1] + _commands(translate)[:1]
    assert "--tokenizer out/data/bpe8k/tokenizer.json" in chain[3] and "--save_checkpoint_steps" in chain[3], chain
    assert "out/serial" in chain[4], chain
    for name in ("data", "run_scripts"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    results, stores = [], []
    for command in chain:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        results.append(proc)
        stores.append({p.parent.name: p.stat().st_mtime_ns
                       for p in (tmp_path / "out/data").glob(".tokcache/*/meta.json")})
    run = json.loads((tmp_path / "out/serial/run.json").read_text())
    assert run["files"]["tokenizer"].endswith("out/data/bpe8k/tokenizer.json"), run["files"]
    assert len(stores[2]) == 1 and stores[3] == stores[2], stores       # Train used the store Prepare built
    assert (tmp_path / "out/serial/checkpoints/step_00000020").is_dir()
    translation = results[4].stdout.splitlines()
    assert len(translation) == 1 and translation[0].strip(), results[4].stdout + results[4].stderr
    assert "step 20" in results[4].stderr, results[4].stderr
