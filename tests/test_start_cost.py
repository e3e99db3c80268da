"""What a start costs in hashing: each checkpoint byte verified once per job, spread over the ranks; the TSV hashed
once per change of the file, by one rank. benchmarks/start_cost.py at tiny size gives the counts (it wraps
common.hashing.file_sha256 in every rank of a real 2-rank --resume auto); the rest are the pieces on their own."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.launch import REPO_ROOT, env, run_python


@pytest.fixture(scope="module")
def tiny_resume(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    work = tmp_path_factory.mktemp("start_cost")
    report = work / "figures.json"
    proc = run_python(
        [
            sys.executable,
            "benchmarks/start_cost.py",
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--size",
            "tiny",
            "--nproc",
            "2",
            "--layouts",
            "tp2",
            "--work",
            work,
            "--json",
            report,
        ],
        env=env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(report.read_text())


def test_the_benchmark_runs_at_tiny_size_and_prints_its_table(tiny_resume):
    stdout, figures = tiny_resume
    assert "| layout | checkpoint | checkpoint bytes hashed, all ranks |" in stdout
    assert any(line.startswith("| tp2 | ") for line in stdout.splitlines()), stdout
    run = figures["layouts"]["tp2"]["runs"]["after"][0]
    assert [r["rank"] for r in run["ranks"]] == [0, 1] and run["first_step_s"] > 0


def test_each_checkpoint_byte_is_hashed_once_per_job_and_the_tsv_once_by_rank_0_on_a_restart(tiny_resume, multi30k_tsv):
    """The code before hashed the whole checkpoint on rank 0 (--resume auto's choice), then on rank 1 both tp2
    shards it read from (replicated weights come from TP rank 0's file): 2× the checkpoint; and the TSV on every
    rank. Now each file of the checkpoint is hashed by exactly one rank, none more than its fair share, and the TSV
    once, by rank 0: the start takes its recorded digest (the save run recorded it), and the full check of what a
    start trusted hashes it beside the steps (training.core.data_recheck)."""
    _, figures = tiny_resume
    layout = figures["layouts"]["tp2"]
    files, ranks = layout["checkpoint_files"], layout["runs"]["after"][0]["ranks"]
    times = {path: sum(1 for r in ranks if path in r["files"]) for path in files}
    assert all(n == 1 for n in times.values()), times
    largest = max(files.values())
    for r in ranks:
        mine = sum(n for path, n in r["files"].items() if path in files)
        assert mine <= layout["checkpoint_bytes"] / len(ranks) + largest / 2, (r["rank"], mine)
    tsv = [r["bytes"]["tsv"] for r in ranks]
    assert tsv == [os.path.getsize(multi30k_tsv)] + [0] * (len(ranks) - 1), tsv


def test_files_are_dealt_largest_first_to_the_least_loaded_rank(tmp_path):
    from training.checkpoint.spread_verify import deal

    sizes = {"a": 100, "b": 100, "c": 60, "d": 50, "r0": 1, "r1": 1}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    assert deal(str(tmp_path), list(sizes), 2) == [["a", "c"], ["b", "d", "r0", "r1"]]  # 160 and 152 bytes
    assert deal(str(tmp_path), list(sizes), 1) == [["a", "b", "c", "d", "r0", "r1"]]
    assert deal(str(tmp_path), ["r0"], 3) == [["r0"], [], []]


def test_the_tsv_digest_is_recorded_reused_while_unchanged_and_taken_again_after_a_change(tmp_path, monkeypatch):
    import preprocess.tsv_digest as tsv_digest
    from common.hashing import file_sha256

    tsv, cache = tmp_path / "data" / "train.tsv", tmp_path / "cache"
    tsv.parent.mkdir()
    tsv.write_text("a\tb\n")
    os.utime(tsv, ns=(1, 1_000_000_000))  # older than any record written now
    hashed = []
    monkeypatch.setattr(tsv_digest, "file_sha256", lambda p: hashed.append(p) or file_sha256(p))
    digest, _ = tsv_digest.tsv_sha256(tsv, cache)
    assert digest == file_sha256(tsv) and len(hashed) == 1
    assert tsv_digest.tsv_sha256(tsv, cache)[0] == digest and len(hashed) == 1  # from the record
    tsv.write_text("a\tc\n")  # same size, new time
    assert tsv_digest.tsv_sha256(tsv, cache)[0] == file_sha256(tsv) != digest and len(hashed) == 2
    hashed.clear()
    tsv.write_text("a\td\n")
    os.utime(tsv, ns=(1, 2_000_000_000))  # a rewrite that keeps the recorded size and inode, new time
    tsv_digest.tsv_sha256(tsv, cache)
    assert len(hashed) == 1


def test_a_cache_folder_that_cannot_be_written_keeps_no_record_and_still_answers(tmp_path):
    from common.hashing import file_sha256
    from preprocess.tsv_digest import tsv_sha256

    tsv = tmp_path / "train.tsv"
    tsv.write_text("a\tb\n")
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would go")
    assert tsv_sha256(tsv, blocker)[0] == file_sha256(tsv)
    assert blocker.is_file()


def test_the_benchmark_help_says_what_it_measures():
    proc = run_python([sys.executable, str(REPO_ROOT / "benchmarks" / "start_cost.py"), "--help"], env=env())
    assert proc.returncode == 0 and "bytes each rank" in proc.stdout and "--compare" in proc.stdout
