"""Damaged checkpoints are refused, by name, wherever they are loaded — and a run can go on from the newest intact one.

One real 1-process run saves steps 2 and 4 (module fixture); each test damages a copy of its output folder the way a
disk, a copy or an older version would, then runs the real commands on it: train.py --resume, evaluate.py,
export_hf.py, average_checkpoints.py. Damage made here: bytes flipped inside a shard (its meta.json checksum no
longer matches), a NaN written into a weight with the checksum updated to match (what a version without the
non-finite checks could have saved), `latest` naming a step that is gone, a field of meta.json of the wrong type.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from common.hashing import file_sha256
from tests.launch import (
    REPO_ROOT,
    concurrently,
    env,
    launch_cmd,
    one_error,
    run_python,
    run_tool,
    run_train,
    step_dir,
    train_flags,
)
from tests.progress import scaled

STEPS = ["--steps", "4", "--save_checkpoint_steps", "2"]


@pytest.fixture(scope="module")
def saved_run(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "run"
    run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, out, *STEPS))
    return out


@pytest.fixture
def run_copy(saved_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    (out / ".train.lock").unlink(missing_ok=True)
    return out


def tensor_span(shard: Path, name: str) -> tuple[int, int]:
    """Byte range of tensor `name` in a safetensors file."""
    with open(shard, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    begin, end = header[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def write_float(shard: Path, name: str, value: float, index: int = 0) -> None:
    start, _ = tensor_span(shard, name)
    with open(shard, "r+b") as f:
        f.seek(start + 4 * index)
        f.write(struct.pack("<f", value))


def restamp(ckpt: Path, fname: str) -> None:
    """Store the file's current sha256 in meta.json, as a save of these bytes would have."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["sha256"][fname] = file_sha256(ckpt / fname)
    (ckpt / "meta.json").write_text(json.dumps(meta, indent=1))


SHARD = "shard_pp0_tp0.safetensors"
WEIGHT = "param/blocks.0.src_word.weight"


def test_every_file_carries_the_sha256_its_writer_computed(saved_run):
    for step in (2, 4):
        ckpt = step_dir(saved_run, step)
        meta = json.loads((ckpt / "meta.json").read_text())
        assert set(meta["sha256"]) == set(meta["shards"] + meta["rng"])
        assert all(meta["sha256"][n] == file_sha256(ckpt / n) for n in meta["sha256"])
        assert not list(ckpt.glob("*.sha256"))  # the writers' notes were folded in


def test_flipped_bytes_are_refused_and_resume_auto_takes_the_newest_intact(run_copy, multi30k_tsv, bpe_tokenizer):
    """A weight of step 4 becomes 1.98e34 on disk (a finite value: only the checksum can tell). --resume names the
    file; --resume auto skips step 4, saying why, and continues from step 2 to the end; --verify 0 loads it."""
    write_float(step_dir(run_copy, 4) / SHARD, WEIGHT, 1.98e34)
    base = train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS)
    proc = run_train(1, base + ["--resume"], check=False)
    one_error(
        proc,
        f"checkpoint {step_dir(run_copy, 4)}: {SHARD} does not match the checksum saved with it",
        "--resume auto picks the newest intact one",
    )
    unchecked = run_train(1, base + ["--resume", "--verify", "0", "--steps", "4"], check=False)
    assert unchecked.returncode == 0 and "nothing to train" in unchecked.stdout, unchecked.stderr[-2000:]
    auto = run_train(1, base + ["--resume", "auto"], check=False)
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert (
        f"--resume auto: skipping step_00000004: checkpoint {step_dir(run_copy, 4)}: {SHARD} does not match"
        in auto.stdout
    )
    assert f"resumed from {step_dir(run_copy, 2)} at step 2" in auto.stdout
    meta = json.loads((step_dir(run_copy, 4) / "meta.json").read_text())  # step 4 saved again, intact
    assert meta["sha256"][SHARD] == file_sha256(step_dir(run_copy, 4) / SHARD)


def test_a_damaged_checkpoint_is_refused_by_evaluate_export_and_averaging(run_copy, bpe_tokenizer, tmp_path):
    write_float(step_dir(run_copy, 4) / SHARD, WEIGHT, 1.98e34)
    src = tmp_path / "src.txt"
    src.write_text("un chien .\n")
    want = f"{SHARD} does not match the checksum saved with it"
    scripts = REPO_ROOT / "run_scripts"
    tok = bpe_tokenizer
    for cmd in (
        [scripts / "evaluate.py", "--ckpt_file", run_copy, "--tokenizer", tok, "--src", src, "--ref", src],
        [scripts / "export_hf.py", "--ckpt_file", run_copy, "--tokenizer", tok, "--output", tmp_path / "hf"],
        [scripts / "average_checkpoints.py", run_copy, "--last", "2", "--output", tmp_path / "avg.pt"],
    ):
        one_error(run_python([sys.executable, *map(str, cmd)], env=env()), want)
    ok = run_python(
        [
            sys.executable,
            str(scripts / "average_checkpoints.py"),
            str(run_copy),
            "--last",
            "2",
            "--output",
            str(tmp_path / "avg.pt"),
            "--no_verify",
        ],
        env=env(),
    )
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_non_finite_weights_are_refused_at_every_load(run_copy, multi30k_tsv, bpe_tokenizer, tmp_path):
    """A NaN in a weight whose checksum matches (as a version without the save-time check could have written):
    resume, evaluate, export and averaging each refuse it in one line naming the tensor."""
    write_float(step_dir(run_copy, 4) / SHARD, WEIGHT, float("nan"), index=3)
    restamp(step_dir(run_copy, 4), SHARD)
    want = "blocks.0.src_word.weight holds 1 non-finite value(s)"
    one_error(run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS, "--resume"), check=False), want)
    scripts = REPO_ROOT / "run_scripts"
    src = tmp_path / "src.txt"
    src.write_text("un chien .\n")
    for cmd in (
        [scripts / "evaluate.py", "--ckpt_file", run_copy, "--tokenizer", bpe_tokenizer, "--src", src, "--ref", src],
        [scripts / "export_hf.py", "--ckpt_file", run_copy, "--tokenizer", bpe_tokenizer, "--output", tmp_path / "hf"],
        [scripts / "average_checkpoints.py", run_copy, "--last", "2", "--output", tmp_path / "avg.pt"],
    ):
        one_error(run_python([sys.executable, *map(str, cmd)], env=env()), want)


def test_latest_naming_a_missing_step_gives_advice_that_works(run_copy, multi30k_tsv, bpe_tokenizer):
    shutil.rmtree(step_dir(run_copy, 4))
    base = train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS)
    line = one_error(run_train(1, base + ["--resume"], check=False), "names step_00000004, which does not exist")
    assert "--resume auto" in line
    auto = run_train(1, base + ["--resume", "auto"], check=False)  # the advice, followed
    assert auto.returncode == 0 and f"resumed from {step_dir(run_copy, 2)} at step 2" in auto.stdout, auto.stderr[
        -3000:
    ]
    named = run_train(1, base + ["--resume", str(step_dir(run_copy, 4)), "--steps", "6"], check=False)
    assert named.returncode == 0 and "at step 4" in named.stdout, named.stderr[-3000:]  # and the other advice


def test_a_meta_json_field_of_the_wrong_type_is_one_line(run_copy, multi30k_tsv, bpe_tokenizer):
    meta_path = step_dir(run_copy, 4) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["optimizer_step"] = "four"
    meta_path.write_text(json.dumps(meta))
    one_error(
        run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS, "--resume"), check=False),
        f"{meta_path}: field 'optimizer_step' is \"four\", not an integer",
    )


@pytest.mark.parametrize(
    "field,value,kind",
    [
        ("vocab_size", 500.0, "an integer"),
        ("dropout", "0.1", "a finite number"),
        ("share_embeddings", 0, "true or false"),
    ],
)
def test_a_model_field_of_the_wrong_type_is_one_line_and_resume_auto_passes_it(
    field, value, kind, run_copy, multi30k_tsv, bpe_tokenizer
):
    """`vocab_size: 500.0` or `dropout: "0.1"` in meta.json traced back when the model was built, and --resume auto
    did not skip the checkpoint."""
    meta_path = step_dir(run_copy, 4) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["model"][field] = value
    meta_path.write_text(json.dumps(meta))
    base = train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS)
    one_error(
        run_train(1, base + ["--resume"], check=False),
        f"{meta_path}: field 'model.{field}' is {json.dumps(value)}, not {kind}",
    )
    auto = run_train(1, base + ["--resume", "auto"], check=False)
    assert auto.returncode == 0 and f"resumed from {step_dir(run_copy, 2)} at step 2" in auto.stdout, auto.stderr[
        -3000:
    ]
    assert f"--resume auto: skipping step_00000004: {meta_path}: field 'model.{field}'" in auto.stdout


def test_a_damaged_tokenizer_copy_gives_advice_that_works(run_copy, multi30k_tsv, bpe_tokenizer, tmp_path):
    """The copy of the tokenizer in step 4 is gone: the error's advice (--tokenizer) works — it was refused even
    with --tokenizer — translate.py takes --tokenizer too, and --resume auto passes the checkpoint."""
    (step_dir(run_copy, 4) / "tokenizer.json").unlink()
    given = train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS)
    i = given.index("--tokenizer")
    base = given[:i] + given[i + 2 :]  # the checkpoint's own tokenizer, as a resume takes it
    line = one_error(run_train(1, base + ["--resume"], check=False), "its tokenizer copy tokenizer.json is missing")
    assert "(--tokenizer)" in line
    named = run_train(1, given + ["--resume", "--steps", "6"], check=False)  # the advice, followed
    assert named.returncode == 0 and f"resumed from {step_dir(run_copy, 4)} at step 4" in named.stdout, named.stderr[
        -3000:
    ]
    src = tmp_path / "in.fr"
    src.write_text("un homme sur un vélo .\n", encoding="utf-8")
    translate = [
        sys.executable,
        str(REPO_ROOT / "run_scripts" / "translate.py"),
        "--ckpt_file",
        str(step_dir(run_copy, 4)),
        "--input",
        str(src),
    ]
    one_error(
        subprocess.run(translate, capture_output=True, text=True, timeout=scaled(300), env=env()),
        "its tokenizer copy tokenizer.json is missing",
    )
    proc = subprocess.run(
        translate + ["--tokenizer", str(bpe_tokenizer)], capture_output=True, text=True, timeout=scaled(300), env=env()
    )
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]


def test_resume_auto_passes_a_checkpoint_whose_tokenizer_copy_is_gone(run_copy, multi30k_tsv, bpe_tokenizer):
    (step_dir(run_copy, 4) / "tokenizer.json").unlink()
    auto = run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS, "--resume", "auto"), check=False)
    assert auto.returncode == 0 and f"resumed from {step_dir(run_copy, 2)} at step 2" in auto.stdout, auto.stderr[
        -3000:
    ]
    assert "--resume auto: skipping step_00000004: checkpoint " in auto.stdout and "tokenizer copy" in auto.stdout


def test_a_meta_json_step_that_is_not_the_checkpoints_is_refused_everywhere(
    run_copy, multi30k_tsv, bpe_tokenizer, tmp_path
):
    """meta.json says step 5 in step_00000004 (a valid integer, another step): --resume resumed "at step 5" on step-4
    weights. Refused in one line by --resume, --ckpt_file, merging and decoding; --resume auto skips it, saying why.
    The folder renamed to match (step_00000005, `latest` too): the shards' headers still say step 4."""
    ckpt = step_dir(run_copy, 4)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "step": 5}))
    base = train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS)
    want = f"{ckpt / 'meta.json'}: step is 5 but the folder's name step_00000004 says 4"
    src = tmp_path / "in.fr"
    src.write_text("un chien .\n")
    resume, fresh, merged, decoded = concurrently(
        lambda: run_train(1, base + ["--resume", "--steps", "6"], check=False),
        lambda: run_train(
            1,
            train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / "new", "--steps", "6", "--ckpt_file", ckpt),
            check=False,
        ),
        lambda: run_tool("merge_checkpoint.py", ckpt, "--output", tmp_path / "m.pt"),
        lambda: run_tool("evaluate.py", "--ckpt_file", run_copy, "--src", src),
    )
    for proc in (resume, fresh, merged, decoded):
        one_error(proc, want, "put the value back, or use another checkpoint")
    auto = run_train(1, base + ["--resume", "auto"], check=False)
    assert auto.returncode == 0 and f"resumed from {step_dir(run_copy, 2)} at step 2" in auto.stdout, auto.stderr[
        -3000:
    ]
    assert f"--resume auto: skipping step_00000004: {want}" in auto.stdout

    renamed = step_dir(run_copy, 5)
    os.rename(ckpt, renamed)  # the step 4 auto saved again, whole
    meta = json.loads((renamed / "meta.json").read_text())
    (renamed / "meta.json").write_text(json.dumps({**meta, "step": 5}))
    (run_copy / "checkpoints" / "latest").write_text(renamed.name)
    headers = (
        f"checkpoint {renamed}: meta.json says step 5, but shard_pp0_tp0.safetensors was saved at step 4 (its header)"
    )
    resume, merged = concurrently(
        lambda: run_train(1, base + ["--resume", "--steps", "6"], check=False),
        lambda: run_tool("merge_checkpoint.py", renamed, "--output", tmp_path / "m.pt"),
    )
    one_error(resume, headers, 'Put back "step": 4')
    one_error(merged, headers)
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("parallel", {"pipeline_stage": "1"}, "field 'parallel.pipeline_stage' is \"1\", not an integer >= 1"),
        ("world_size", 2, "world_size is 2 but parallel's data_parallel × model_parallel × pipeline_stage say 1"),
        ("sha256", {}, 'sha256 is ["shard_pp0_tp0.safetensors"] but shards and rng list'),
        ("lr_scheduler", {"last_epoch": 4}, "field 'lr_scheduler' is {\"last_epoch\": 4}, not"),
        ("seed", 8, "seed is 8 but data_order says 7"),
    ],
    ids=["stage-as-text", "world", "a-digest-dropped", "no-last-lr", "seed"],
)
def test_a_layout_or_a_value_stated_twice_that_disagrees_is_one_line(field, value, needle, run_copy, tmp_path):
    """Read as the loaders read meta.json: "pipeline_stage": "1" traced back in range(); a world_size, a sha256 list
    missing a file (that file then went unchecked) or a seed that the rest of meta.json contradicts were loaded."""
    path = step_dir(run_copy, 4) / "meta.json"
    meta = json.loads(path.read_text())
    if field == "parallel":
        value = {**meta["parallel"], **value}
    elif field == "sha256":
        value = {"shard_pp0_tp0.safetensors": meta["sha256"]["shard_pp0_tp0.safetensors"]}
    path.write_text(json.dumps({**meta, field: value}))
    one_error(run_tool("merge_checkpoint.py", run_copy, "--output", tmp_path / "m.pt"), f"{path}: {needle}")


@pytest.mark.parametrize("kind", ["relative", "absolute", "link"])
def test_latest_naming_a_folder_outside_the_run_is_refused(
    kind, saved_run, run_copy, multi30k_tsv, bpe_tokenizer, tmp_path
):
    """checkpoints/latest naming another run's step folder — a path up and out, an absolute path, or a step folder
    of its own name that links out — was followed by --resume (which then continued the other run's weights in this
    folder) and by --ckpt_file RUN. Every reader of `latest` refuses it; the advice (--resume auto) works."""
    other = tmp_path / "other"
    shutil.copytree(saved_run, other)
    root = run_copy / "checkpoints"
    pointer = {
        "relative": "../../other/checkpoints/step_00000004",
        "absolute": str(step_dir(other, 4)),
        "link": "step_00000006",
    }[kind]
    if kind == "link":
        (root / "step_00000006").symlink_to(step_dir(other, 4))
    (root / "latest").write_text(pointer)
    want = f"{root / 'latest'} names "
    base = train_flags(multi30k_tsv, bpe_tokenizer, run_copy, *STEPS)
    src = tmp_path / "in.fr"
    src.write_text("un chien .\n")
    results = concurrently(
        lambda: run_train(1, base + ["--resume", "--steps", "6"], check=False),
        lambda: run_train(
            1,
            train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / "new", "--steps", "6", "--ckpt_file", run_copy),
            check=False,
        ),
        lambda: run_tool("evaluate.py", "--ckpt_file", run_copy / "latest", "--src", src),
        lambda: run_tool("translate.py", "--ckpt_file", root / "latest", "--input", src),
        lambda: run_tool("merge_checkpoint.py", run_copy, "--output", tmp_path / "m.pt"),
    )
    for proc in results:
        one_error(proc, want, "`latest` must name a checkpoint of this run (a step_N folder of", "--resume auto")
    assert not (tmp_path / "new" / "checkpoints").exists() and not (tmp_path / "m.pt").exists()
    if kind == "link":
        return  # --resume auto would take step_00000006, whose meta.json says step 4: refused
    auto = run_train(1, base + ["--resume", "auto", "--steps", "6"], check=False)
    assert auto.returncode == 0 and f"resumed from {step_dir(run_copy, 4)} at step 4" in auto.stdout, auto.stderr[
        -3000:
    ]
    assert (root / "latest").read_text() == "step_00000006"  # its own, once more
    named = run_tool("translate.py", "--ckpt_file", root / "latest", "--input", src)  # the pointer file itself
    assert named.returncode == 0 and "step_00000006 (step 6; latest" in named.stderr, named.stderr[-2000:]


def test_a_fresh_run_keeps_the_records_of_an_earlier_one_without_checkpoints(multi30k_tsv, bpe_tokenizer, tmp_path):
    out = tmp_path / "run"
    run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, out, "--steps", "2"))
    first = (out / "metrics.jsonl").read_text()
    proc = run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, out, "--steps", "3"))
    assert f"kept as {out / 'metrics.1.jsonl'}" in proc.stdout
    assert (out / "metrics.1.jsonl").read_text() == first
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_full_disk_while_logging_leaves_whole_records(multi30k_tsv, bpe_tokenizer, tmp_path):
    """metrics.jsonl under a 6 KiB file-size limit (EFBIG, as a full disk's ENOSPC): the run stops in one line
    naming the step, and the file ends with the previous step's record, whole."""
    out = tmp_path / "run"
    limit = 6 << 10
    argv = train_flags(multi30k_tsv, bpe_tokenizer, out, "--steps", "60")
    proc = subprocess.run(
        launch_cmd(1) + [str(a) for a in argv],
        cwd=REPO_ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(300),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    line = one_error(proc, f"writing {out / 'metrics.jsonl'} failed at step ", "continue with --resume")
    failed = int(line.split("failed at step ")[1].split()[0])
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and os.path.getsize(out / "metrics.jsonl") <= limit
    assert [json.loads(r)["step"] for r in text.splitlines()] == list(range(1, failed))


@pytest.fixture(scope="module")
def saved_tp2_run(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity-tp2") / "run"
    run_train(2, train_flags(multi30k_tsv, bpe_tokenizer, out, *STEPS, "--mp", "2"))
    return out


def test_on_two_ranks_the_damage_one_rank_finds_is_every_ranks_line_and_resume_auto_falls_back(
    saved_tp2_run, multi30k_tsv, bpe_tokenizer, tmp_path
):
    """Each file is hashed by one rank (training.checkpoint.spread_verify): TP rank 1's shard by rank 1. Its
    verdict reaches rank 0, so --resume stops with one line naming the file, and --resume auto skips step 4 (saying
    why, on rank 0) and resumes every rank from step 2."""
    out = tmp_path / "run"
    shutil.copytree(saved_tp2_run, out)
    (out / ".train.lock").unlink(missing_ok=True)
    damaged = "shard_pp0_tp1.safetensors"
    write_float(step_dir(out, 4) / damaged, WEIGHT, 1.98e34)
    base = train_flags(multi30k_tsv, bpe_tokenizer, out, *STEPS, "--mp", "2")
    one_error(
        run_train(2, base + ["--resume"], check=False),
        f"checkpoint {step_dir(out, 4)}: {damaged} does not match the checksum saved with it",
    )
    auto = run_train(2, base + ["--resume", "auto"], check=False)
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert (
        f"--resume auto: skipping step_00000004: checkpoint {step_dir(out, 4)}: {damaged} does not match" in auto.stdout
    )
    assert f"resumed from {step_dir(out, 2)} at step 2" in auto.stdout


def test_on_two_ranks_resume_auto_passes_a_checkpoint_whose_tokenizer_copy_is_gone(
    saved_tp2_run, multi30k_tsv, bpe_tokenizer, tmp_path
):
    """The spread verification (several ranks) checks the tokenizer copy as the one-process one does."""
    out = tmp_path / "run"
    shutil.copytree(saved_tp2_run, out)
    (out / ".train.lock").unlink(missing_ok=True)
    (step_dir(out, 4) / "tokenizer.json").unlink()
    auto = run_train(
        2, train_flags(multi30k_tsv, bpe_tokenizer, out, *STEPS, "--mp", "2", "--resume", "auto"), check=False
    )
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert f"resumed from {step_dir(out, 2)} at step 2" in auto.stdout
    assert "--resume auto: skipping step_00000004: checkpoint " in auto.stdout and "tokenizer copy" in auto.stdout


def test_a_latest_pointer_gone_between_a_look_and_the_read_is_no_checkpoint(tmp_path, monkeypatch):
    """A save replaces `latest` while another process reads it (a translate.py --ckpt_file RUN beside training): a
    pointer seen and gone before it was read means no checkpoint yet, not a TypeError from joining None."""
    from training.checkpoint import folder

    (tmp_path / "step_00000002").mkdir()
    monkeypatch.setattr(os.path, "isfile", lambda path: True)  # it was there when looked at, gone when read
    assert folder.latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest").write_text("step_00000002")
    assert folder.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000002")
