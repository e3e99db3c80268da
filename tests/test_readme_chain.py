"""The README's commands, run as written, in a scratch folder holding links to data/ and run_scripts/ (so `out/`
lands there, not in the checkout):
- Prepare → Train → Translate: Train uses the tokenizer, lengths and token store Prepare made and saves a checkpoint,
  and Translate reads it;
- "Any corpus you have": the datasets folder and JSONL lines train (the user's files made here from Multi30k, in the
  shapes the lines name), the Hub line ends in one line without the network;
- Validate, then the installed `dstr-translate` on the run's best checkpoint, answered through a pipe.
The one liberty taken: a `deepspeed` line that names no port gets a free `--master_port` (never the default 29500
other jobs may hold), as the README says any may take; a line that names one (Train's) runs as written."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.multiproc import free_port
from tests.progress import scaled

# the README's commands are the installed ones (dstr-*): `pip install -e .`, as the README's two commands do
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("dstr-train") is None, reason="the console commands are not installed (pip install -e .)"
    ),
]


def _commands(block: str) -> list[str]:
    """A bash block's commands: comments dropped, backslash continuations joined."""
    text = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _blocks(title: str) -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def _block_after(title: str, lead: str) -> list[str]:
    """The commands of the first bash block that follows the paragraph starting with `lead` in section `title`."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return _commands(re.search(r"```bash\n(.*?)```", section.split(lead, 1)[1], re.S).group(1))


@pytest.fixture
def scratch(tmp_path):
    for name in ("data", "run_scripts"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    return tmp_path


def _env(**extra) -> dict:
    return dict(
        os.environ,
        PYTHONPATH=str(REPO_ROOT),
        OMP_NUM_THREADS="1",
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        **extra,
    )


def _run(command: str, cwd, env=None, ok=True, stdin=None) -> subprocess.CompletedProcess:
    if command.startswith("deepspeed ") and "--master_port" not in command:
        command = command.replace("deepspeed ", f"deepspeed --master_port {free_port()} ", 1)
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=scaled(900),
        input=stdin,
    )
    if ok:
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def _stores(folder) -> dict:
    return {p.parent.name: p.stat().st_mtime_ns for p in folder.glob(".tokcache/*/meta.json")}


def test_prepare_train_translate_chain(scratch):
    prepare = _block_after("Train on your own data", "**Prepare data**")
    train = _block_after("Train on your own data", "**Train** in one process")
    translate = _commands(_blocks("Translate, evaluate, average, export to transformers")[0])
    one_process = [c for c in train if not c.startswith("deepspeed")]
    chain = prepare + one_process[:1] + translate[:1]
    assert "--tokenizer out/data/bpe8k/tokenizer.json" in chain[3] and "--save_checkpoint_steps" in chain[3], chain
    assert "out/serial" in chain[4], chain
    results, stores = [], []
    for command in chain:
        results.append(_run(command, scratch))
        stores.append(_stores(scratch / "out/data"))
    run = json.loads((scratch / "out/serial/run.json").read_text())
    assert run["files"]["tokenizer"].endswith("out/data/bpe8k/tokenizer.json"), run["files"]
    assert len(stores[2]) == 1 and stores[3] == stores[2], stores  # Train used the store Prepare built
    assert (scratch / "out/serial/checkpoints/step_00000020").is_dir()
    translation = results[4].stdout.splitlines()
    assert len(translation) == 1 and translation[0].strip(), results[4].stdout + results[4].stderr
    assert "step 20" in results[4].stderr, results[4].stderr
    # the seed's 2-card run as written: its own free port ($(python run_scripts/free_port.py)), not DeepSpeed's 29500
    (tp2,) = [c for c in train if c.startswith("deepspeed")]
    assert "--master_port $(python run_scripts/free_port.py)" in tp2, tp2
    launched = _run(tp2, scratch)
    port = re.search(r"--master_port=(\d+)", launched.stdout + launched.stderr)  # DeepSpeed's runner logs its cmd
    assert port and int(port.group(1)) != 29500, launched.stdout[-2000:]
    assert [json.loads(line)["step"] for line in (scratch / "out/tp2/metrics.jsonl").read_text().splitlines()][-1] == 20


def _multi30k_pairs(n: int) -> list[tuple[str, str]]:
    def lines(name):
        with gzip.open(REPO_ROOT / "data/multi30k" / name, "rt", encoding="utf-8") as f:
            return [next(f).strip() for _ in range(n)]

    return list(zip(lines("train.fr.gz"), lines("train.en.gz")))


def test_any_corpus_lines(scratch):
    """The folder and JSONL lines train 20 steps on files in the shapes they name (the folder as the README's
    save_to_disk line writes it, from Multi30k pairs instead of WMT14, which needs the network); the Hub line,
    offline, is one `error:` line that says how to bring the data."""
    import datasets

    commands = _block_after("Train on your own data", "**Any corpus you have**")
    fetch, folder, hub, jsonl = commands
    assert "save_to_disk('wmt14_fr_en')" in fetch and "--file_path wmt14_fr_en " in folder, commands
    pairs = _multi30k_pairs(2000)
    rows = {"translation": [{"fr": fr, "en": en} for fr, en in pairs]}
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(rows),
            "validation": datasets.Dataset.from_dict({k: v[:50] for k, v in rows.items()}),
        }
    ).save_to_disk(str(scratch / "wmt14_fr_en"))
    with open(scratch / "pairs.jsonl", "w", encoding="utf-8") as f:
        for fr, en in pairs:
            f.write(json.dumps({"english": en, "french": fr}, ensure_ascii=False) + "\n")
    for command, out in ((folder, "out/wmt"), (jsonl, "out/j")):
        _run(command, scratch)
        steps = [
            json.loads(line)["step"]
            for line in (scratch / out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line
        ]
        assert steps[-1] == 20, steps
    offline = _run(hub, scratch, env=_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"), ok=False)
    errors = [line for line in offline.stderr.splitlines() if line.startswith("error:")]
    assert offline.returncode != 0 and len(errors) == 1 and "save_to_disk" in errors[0], offline.stderr[-2000:]
    assert "Traceback" not in offline.stderr, offline.stderr[-2000:]


def test_validate_then_translate_the_best_checkpoint(scratch):
    """The Validate block (2 ranks, 400 steps, validation every 100), then the README's `dstr-translate` line on
    the run's best checkpoint: one translation, and stderr says the checkpoint is the best validation's."""
    prepare = _block_after("Train on your own data", "**Prepare data**")
    _run(prepare[0], scratch)  # the training TSV the Validate block reads
    for command in _block_after("Train on your own data", "**Validate, schedule the learning rate"):
        _run(command, scratch)
    assert (scratch / "out/valid-run/checkpoints/best").is_dir()
    line = next(
        c
        for c in _commands(_blocks("Translate, evaluate, average, export to transformers")[0])
        if "out/valid-run/best" in c
    )
    assert line.split("|")[1].split()[0] == "dstr-translate", line
    proc = _run(line, scratch)
    assert len(proc.stdout.splitlines()) == 1 and proc.stdout.strip(), proc.stdout + proc.stderr
    assert "best" in proc.stderr and "valid_loss" in proc.stderr, proc.stderr[-2000:]


def test_resume_block_saves_and_merge_consolidates_to_safetensors(scratch):
    """The Resume block's first run (2 ranks, tp2, saves every 10 steps), then its `dstr-merge-checkpoint` line as
    written: one .safetensors of the serial model's weights, which the README says replaces DeepSpeed's
    zero_to_fp32."""
    from safetensors import safe_open

    prepare = _block_after("Train on your own data", "**Prepare data**")
    _run(prepare[0], scratch)
    block = _blocks("Resume and continue on another layout")[0]
    commands = _commands(block)
    merge = next(c for c in commands if c.startswith("dstr-merge-checkpoint"))
    _run(commands[0], scratch)
    _run(merge, scratch)
    out = scratch / merge.split("--output ", 1)[1].split()[0]
    with safe_open(str(out), "pt") as f:
        assert int(f.metadata()["step"]) == 40 and len(list(f.keys())) > 0, f.metadata()
