"""Nothing a user has is lost to a command: an output that is one of the command's inputs is refused in one line and
the input kept, and a staging file or folder is always one the command created itself.

One real 1-process run saves step 2 (module fixture); the real commands then run on it:
- evaluate.py / translate.py with --output naming --src, --ref, --input, the file on stdin, a file of the checkpoint
  or the consolidated file they decode — by the same path, a symbolic link, another spelling, a hard link;
  merge_checkpoint.py / average_checkpoints.py / the checkpoint folder's zero_to_fp32.py writing over a file they
  read; export_hf.py --overwrite of a folder holding what it exports; preprocess.parallel --output naming --src;
  rank_table_to_hostfile.py -o naming the rank table; plan.py --write_hostfile naming --hostfile (each was written
  over, exit 0);
- convert_checkpoint.py OLD NEW keeps a user's NEW.tmp folder (it was emptied, or renamed into NEW), leaves nothing
  after a failed conversion, and a malformed format-1 meta.json is one line (KeyError, AttributeError, TypeError
  tracebacks were seen); merge_checkpoint.py keeps a user's OUT.part, and a consolidated save that fails leaves none.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import REPO_ROOT, TINY, concurrently, env, run_python, run_tool, run_train, usage_error

SCRIPTS = REPO_ROOT / "run_scripts"
STEP = "step_00000002"


def snapshot(folder: Path) -> dict:
    """{relative path: bytes, or the target of a symbolic link} of everything under `folder`."""
    return {
        str(p.relative_to(folder)): (f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


@pytest.fixture(scope="module")
def saved(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("nothing-lost") / "run"
    run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            2,
            "--save_checkpoint_steps",
            2,
        ],
    )
    return out


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "src.fr").write_text("un chien court .\nune maison rouge .\n")
    (folder / "ref.en").write_text("a dog runs .\na red house .\n")
    (folder / "link.fr").symlink_to("src.fr")
    os.link(folder / "src.fr", folder / "hard.fr")
    return folder


def test_evaluate_and_translate_refuse_an_output_that_is_an_input(saved, texts):
    src, ref = texts / "src.fr", texts / "ref.en"
    ckpt = saved / "checkpoints" / STEP
    before, run_before = snapshot(texts), snapshot(saved / "checkpoints")
    evaluate = ["--ckpt_file", saved, "--src", src, "--ref", ref]
    cases = [  # (script, args, what the line must say)
        ("evaluate.py", [*evaluate, "--output", src], f"--output {src} is --src {src}:"),
        ("evaluate.py", [*evaluate, "--output", ref], f"--output {ref} is --ref {ref}:"),
        ("evaluate.py", [*evaluate, "--output", texts / "link.fr"], "(the same file under another name)"),
        ("evaluate.py", [*evaluate, "--output", f"{texts}/../{texts.name}/src.fr"], f"is --src {src}"),
        ("evaluate.py", [*evaluate, "--output", texts / "hard.fr"], "(the same file under another name)"),
        ("evaluate.py", [*evaluate, "--output", ckpt / "meta.json"], f"is meta.json of the checkpoint {ckpt}"),
        ("evaluate.py", [*evaluate, "--output", ckpt / "shard_pp0_tp0.safetensors"], "shard_pp0_tp0.safetensors of"),
        ("translate.py", ["--ckpt_file", f"{saved}/latest", "--input", src, "--output", src], f"is --input {src}"),
        ("translate.py", ["--ckpt_file", saved, "--input", src, "--output", texts / "link.fr"], "the same file"),
        (
            "translate.py",
            ["--ckpt_file", saved, "--tokenizer", ckpt, "--output", ckpt / "tokenizer.json"],
            f"is --tokenizer {ckpt}",
        ),
    ]
    results = concurrently(*(lambda s=s, a=a: run_tool(s, *a) for s, a, _ in cases))
    for (_, _, needle), proc in zip(cases, results, strict=True):
        usage_error(proc, needle, "writing there would replace what the command reads; give another output file")
    # the shell's `translate.py --output F < F`: stdin is F
    usage_error(
        run_tool("translate.py", "--ckpt_file", saved, "--output", src, stdin=src),
        f"--output {src} is the file on stdin",
    )
    assert snapshot(texts) == before and snapshot(saved / "checkpoints") == run_before
    ok = run_tool("translate.py", "--ckpt_file", saved, "--output", texts / "out.en", stdin=src)  # the refusal's advice
    assert ok.returncode == 0 and len((texts / "out.en").read_text().splitlines()) == 2, ok.stderr[-2000:]


def test_merge_average_and_zero_to_fp32_never_write_over_what_they_read(saved, tmp_path):
    ckpt = saved / "checkpoints" / STEP
    merged, users = tmp_path / "model.pt", tmp_path / "model.pt.part"
    users.write_text("a file of the user's that happens to have this name")
    ok = run_tool("merge_checkpoint.py", saved, "--output", merged)
    assert ok.returncode == 0, ok.stderr[-2000:]
    # the save's staging file was its own: the user's model.pt.part is as it was, and no other file is left
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt.part"]
    assert users.read_text() == "a file of the user's that happens to have this name"
    before, pt = snapshot(saved / "checkpoints"), merged.read_bytes()
    results = concurrently(
        lambda: run_tool("merge_checkpoint.py", ckpt, "--output", ckpt / "shard_pp0_tp0.safetensors"),
        lambda: run_tool("average_checkpoints.py", merged, ckpt, "--output", merged),
        lambda: run_tool(ckpt / "zero_to_fp32.py", ".", "rng_rank0.safetensors", cwd=ckpt),
        lambda: run_tool(
            "evaluate.py",
            "--ckpt_file",
            merged,
            "--src",
            REPO_ROOT / "data" / "multi30k" / "val.fr.gz",
            "--output",
            merged,
        ),
    )
    usage_error(results[0], f"--output {ckpt}/shard_pp0_tp0.safetensors is shard_pp0_tp0.safetensors of the checkpoint")
    usage_error(results[1], f"--output {merged} is the input {merged}")
    usage_error(results[2], f"output rng_rank0.safetensors is rng_rank0.safetensors of the checkpoint {ckpt}")
    usage_error(results[3], f"--output {merged} is --ckpt_file {merged}")
    assert snapshot(saved / "checkpoints") == before and merged.read_bytes() == pt


def test_export_overwrite_never_deletes_what_it_exports(saved, tmp_path):
    """An earlier export's folder that also holds the merged model: --overwrite of it would export the model, then
    delete it with the folder."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert run_tool("merge_checkpoint.py", saved, "--output", hf / "model.pt").returncode == 0
    before = snapshot(hf)
    usage_error(
        run_tool("export_hf.py", "--ckpt_file", hf / "model.pt", "--output", hf, "--overwrite"),
        f"--output {hf} holds --ckpt_file {hf / 'model.pt'}: replacing the folder would delete it",
    )
    assert snapshot(hf) == before


def test_a_consolidated_save_that_fails_leaves_nothing(tmp_path):
    """The staging file is removed when the writer fails (a .part was left behind), whatever the form."""
    from training.checkpoint.consolidated import save

    obj = {"model": {"w": torch.ones(2)}, "model_config": {}, "step": 1, "unpicklable": lambda: None}
    for name in ("model.pt", "model.bin"):
        with pytest.raises(Exception):  # noqa: B017 - pickle's own error, whichever it is
            save({**obj, "model": obj} if name.endswith(".bin") else obj, str(tmp_path / name))
    assert os.listdir(tmp_path) == []


def test_text_tools_refuse_an_output_that_is_an_input(tmp_path, multi30k_dir):
    """preprocess.parallel --output = --src; rank_table_to_hostfile.py -o = its rank table; plan.py --write_hostfile
    = --hostfile: each read its input, then wrote over it."""
    fr, en = tmp_path / "a.fr", tmp_path / "a.en"
    fr.write_text("un chien .\n")
    en.write_text("a dog .\n")
    table = tmp_path / "rank_table.json"
    shutil.copy(SCRIPTS / "rank_tables" / "rank_table_2pcs.json", table)
    hosts = tmp_path / "hostfile"
    hosts.write_text("# our two nodes\n192.0.2.10 slots=8\n192.0.2.11 slots=8\n")
    before = snapshot(tmp_path)
    results = concurrently(
        lambda: run_python(
            [sys.executable, "-m", "preprocess.parallel", "--src", fr, "--tgt", en, "--output", fr], env=env()
        ),
        lambda: run_tool("rank_table_to_hostfile.py", table, "-o", table),
        lambda: run_tool(
            "plan.py",
            "--recipe",
            REPO_ROOT / "recipes" / "16pcs" / "16pcs.json",
            "--hostfile",
            hosts,
            "--write_hostfile",
            hosts,
            "--check",
        ),
    )
    usage_error(results[0], f"--output {fr} is --src {fr}")
    usage_error(results[1], f"-o {table} is the rank table {table}")
    usage_error(results[2], f"--write_hostfile {hosts} is --hostfile {hosts}")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------ convert_checkpoint.py
@pytest.fixture
def format_1(saved, tmp_path):
    """step 2 of the run in format 1 (torch .pt shards), as tests/test_checkpoint.py writes it."""
    from tests.test_checkpoint import _write_format_1

    old = tmp_path / "old" / STEP
    old.parent.mkdir()
    _write_format_1(saved / "checkpoints" / STEP, old)
    return old


def test_convert_never_touches_a_folder_it_did_not_create(format_1, tmp_path):
    """A user's NEW.tmp folder: kept through a conversion that succeeds (it was renamed into NEW) and one that fails
    (it was emptied); a failed conversion leaves nothing of its own, not even the folders it made for NEW."""
    from training.checkpoint.format import read_meta

    users = tmp_path / "old" / "v2.tmp"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    new = tmp_path / "old" / "v2"
    ok = run_tool("convert_checkpoint.py", format_1, new)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert read_meta(str(new))["step"] == 2 and not (new / "notes.txt").exists()
    assert sorted(os.listdir(tmp_path / "old")) == [STEP, "v2", "v2.tmp"]
    assert (users / "notes.txt").read_text() == "mine"
    assert oct(new.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # not mkdtemp's 0700

    (format_1 / "rng_rank0.pt").write_bytes(b"not a torch file")  # fails after the shard is written
    deeper = tmp_path / "new" / "a" / "v2"
    (tmp_path / "new").mkdir()
    deeper_tmp = tmp_path / "new" / "a" / "v2.tmp"
    failed = run_tool("convert_checkpoint.py", format_1, deeper)
    usage_error(failed, f"checkpoint file {format_1}/rng_rank0.pt is corrupt, truncated or not a format-1 file")
    assert os.listdir(tmp_path / "new") == [] and not deeper_tmp.exists()
    (tmp_path / "new" / "a").mkdir()
    deeper_tmp.mkdir()
    (deeper_tmp / "notes.txt").write_text("mine")
    usage_error(run_tool("convert_checkpoint.py", format_1, deeper), "rng_rank0.pt is corrupt")
    assert os.listdir(tmp_path / "new" / "a") == ["v2.tmp"] and (deeper_tmp / "notes.txt").read_text() == "mine"


def _umask() -> int:
    from common.file_modes import umask

    return umask()


@pytest.mark.parametrize(
    "meta,needle",
    [
        ({"format_version": 1}, "field 'parallel' is missing"),
        ([1], "holds [1], not the object a checkpoint's meta.json is"),
        ("format 1", 'holds "format 1", not the object'),
        ({"pipeline_stage": "2"}, "field 'parallel.pipeline_stage' is \"2\", not an integer >= 1"),
        ({"step": 3}, "step is 3 but the folder's name step_00000002 says 2"),
        ({"lr_scheduler": {"last_epoch": 2}}, "field 'lr_scheduler' is"),
        ({"world_size": 2}, "world_size is 2 but parallel's data_parallel × model_parallel × pipeline_stage say 1"),
    ],
    ids=["no-fields", "list", "string", "stage-as-text", "other-step", "no-last-lr", "other-world"],
)
def test_convert_a_malformed_format_1_meta_is_one_line(meta, needle, format_1, tmp_path):
    saved = json.loads((format_1 / "meta.json").read_text())
    if isinstance(meta, dict) and "format_version" not in meta:  # one field changed in the real meta.json
        meta = {**saved, "parallel": {**saved["parallel"], **meta}} if "pipeline_stage" in meta else {**saved, **meta}
    (format_1 / "meta.json").write_text(json.dumps(meta))
    usage_error(run_tool("convert_checkpoint.py", format_1, format_1.parent / "v2"), f"{format_1}", needle)
    assert sorted(os.listdir(format_1.parent)) == [STEP]
