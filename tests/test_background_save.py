"""Background saves (--save_mode background, training.checkpoint.background): the same bytes as a synchronous save,
training goes on while the files are written, and a kill -9 while a save is in flight resumes from the previous
checkpoint exactly. Real 2-rank train.py runs on Multi30k; the benchmark (benchmarks/save_stall.py) at toy size.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import REPO_ROOT, env, launch_cmd, losses, merged, read_metrics, run_python, train_flags
from tests.multiproc import free_port
from tests.progress import scaled

FIXED_IDS = str(REPO_ROOT / "tests" / "drivers" / "fixed_ids.py")
TRAIN_MANY = str(REPO_ROOT / "tests" / "drivers" / "train_many.py")
LAYOUTS = {"tp2-drop": ["--mp", "2", "--dropout", "0.1"], "dp2-zero3": ["--zero_stage", "3"]}


def file_sums(out: Path) -> dict:
    root = out / "checkpoints"
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_background_saves_write_the_same_bytes_and_losses_as_synchronous_ones(multi30k_tsv, bpe_tokenizer, tmp_path):
    """tp2 with dropout (the RNG streams are in the snapshot) and dp2 under ZeRO-3 (the gathers are collectives, one
    rank only takes part), 4 steps saving every step: each mode's runs in one launch, checkpoint ids drawn from a
    counter (tests/drivers/fixed_ids.py). Every file of every checkpoint — shards, RNG files, meta.json with its
    sha256 list — has the same sha256 in both modes, and the losses are the same bits."""
    for mode in ("sync", "background"):
        runs = [
            train_flags(
                multi30k_tsv,
                bpe_tokenizer,
                tmp_path / mode / name,
                *layout,
                "--steps",
                4,
                "--save_checkpoint_steps",
                1,
                "--keep_checkpoint_max",
                10,
                "--save_mode",
                mode,
            )
            for name, layout in LAYOUTS.items()
        ]
        runs_file = tmp_path / f"{mode}.json"
        runs_file.write_text(json.dumps([[str(a) for a in r] for r in runs]))
        proc = run_python(launch_cmd(2, FIXED_IDS) + [TRAIN_MANY, str(runs_file)], env=env(), timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in LAYOUTS:
        sync, background = tmp_path / "sync" / name, tmp_path / "background" / name
        sums = file_sums(sync)
        assert len([f for f in sums if f.endswith("meta.json")]) == 4, sums
        assert file_sums(background) == sums, name
        assert losses(background) == losses(sync), name


def test_kill_9_while_a_background_save_is_written_resumes_from_the_previous_checkpoint(
    multi30k_tsv, bpe_tokenizer, tmp_path
):
    """tp2 with dropout, 8 steps, a save every 2. Step 4's files are held back 3 s (DSR_SAVE_DELAY) and rank 0 is
    killed (kill -9) at their end (DSR_CRASH_AT=save:4): training went on meanwhile (step 5 was logged while the save
    was in flight), step_4 was never committed (step_00000004.tmp is left, `latest` names step_2). --resume auto then
    continues from step_2, and losses, master weights and AdamW moments equal an uninterrupted run's bit for bit."""
    common = ["--mp", "2", "--dropout", "0.1", "--steps", 8, "--save_checkpoint_steps", 2, "--save_mode", "background"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    proc = run_python(
        launch_cmd(2) + [str(a) for a in train_flags(multi30k_tsv, bpe_tokenizer, ref, *common)], env=env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    killed = subprocess.run(
        launch_cmd(2) + [str(a) for a in train_flags(multi30k_tsv, bpe_tokenizer, out, *common)],
        cwd=REPO_ROOT,
        env=dict(env(), DSR_SAVE_DELAY="3", DSR_CRASH_AT="save:4"),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert killed.returncode != 0, killed.stdout[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert (ckpts / "step_00000004.tmp").is_dir() and not (ckpts / "step_00000004").exists()
    assert max(r["step"] for r in read_metrics(out)) >= 5  # the loop went on while step 4 was written

    resumed = run_python(
        launch_cmd(2) + [str(a) for a in train_flags(multi30k_tsv, bpe_tokenizer, out, *common, "--resume", "auto")],
        env=env(),
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in resumed.stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    assert losses(out) == losses(ref)
    a, b = merged(ref), merged(out)
    assert a["step"] == b["step"] == 8
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["optimizer"][name][key], b["optimizer"][name][key]), (name, key)
    assert not list(ckpts.glob("*.tmp"))  # the partial save was cleaned up
    from training.checkpoint.recovery_script import HINT, SCRIPT

    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        ["latest", "step_00000002", "step_00000004", "step_00000006", "step_00000008", HINT, SCRIPT]
    )


def test_save_stall_benchmark_at_toy_size(multi30k_tsv, bpe_tokenizer):
    """benchmarks/save_stall.py end to end on a toy model: both modes run and the table has a row for each."""
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/save_stall.py",
            "--file_path",
            str(multi30k_tsv),
            "--tokenizer",
            str(bpe_tokenizer),
            "--size",
            "tiny",
            "--steps",
            "7",
            "--every",
            "3",
            "--port",
            str(free_port()),
        ],
        cwd=REPO_ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("| mode |") :].splitlines()
    assert [row.split("|")[1].strip() for row in table[2:4]] == ["sync", "background"], table
    assert len(table[3].split("|")[3].split(",")) == 2  # saves 3 and 6 (7's, the last, is not counted)


@pytest.mark.parametrize("steps,every", [("4", "4")])
def test_save_stall_benchmark_refuses_too_few_steps(steps, every, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/save_stall.py",
            "--file_path",
            "x",
            "--tokenizer",
            "y",
            "--steps",
            steps,
            "--every",
            every,
        ],
        cwd=REPO_ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 2 and "--steps 4 must be larger than --every 4" in proc.stderr, proc.stderr
