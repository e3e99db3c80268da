"""A start that does not get to train leaves nothing behind, and ends when asked.

- A stop request (SIGTERM, SIGUSR1, SIGHUP, Ctrl-C's SIGINT) while train.py builds its token store ends the build at
  once — not after it (the launchers' grace is 30-40 s; a first build of a large corpus takes minutes) — removes the
  half-built store, says so in one line and exits 128 + the signal; on 2 ranks stopped through DeepSpeed's launcher
  too; a later start builds the store and trains.
- A run that ends in a usage error (`dstr-train` with no arguments, a layout that does not fit) creates no output
  folder and no lock file; a lock file it did not create stays.
Real train.py processes on a synthetic corpus of Multi30k sentences (its build takes several seconds here)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from preprocess.tsv_digest import RECORDS
from tests.launch import env, launch_cmd, read_metrics, run_python, run_train, train_flags
from tests.progress import load_factor, scaled, wait_exit, wait_until
from tests.test_faults import Job, _processes_naming

# how a process ends and what it leaves is the subject: every command is its own interpreter
pytestmark = pytest.mark.usefixtures("real_interpreters")


def building(cache: Path) -> bool:
    """The store's writer has written its first chunk (the build is under way)."""
    return any(p.stat().st_size > 0 for p in cache.glob(".tmp-*/src.tokens"))


def left_in(cache: Path) -> list[str]:
    """What the build left in the cache folder (the corpus's digest record may stay: it is not the build's)."""
    return sorted(p.name for p in cache.iterdir() if p.name != RECORDS) if cache.exists() else []


def lines_of(text: str) -> list[str]:
    """Output lines, without the progress bar's redraws."""
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip() and "tokenizing" not in line]


def stop_during_build(cmd: list, cache: Path, folder: Path, sig: int) -> tuple:
    """Start `cmd`, send `sig` once the build writes, wait for the end: (completed process, seconds to the end)."""
    job = Job(cmd, folder, env())
    wait_until(lambda: building(cache), job.popen, 120, "the store's build", files=[job.err])
    job.popen.send_signal(sig)
    sent = time.monotonic()
    wait_exit(job.popen, 20, f"train.py after {signal.Signals(sig).name} during the build", files=[job.err])
    took = time.monotonic() - sent
    return job.finish(1), took


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_request_during_the_build_ends_it_at_once_and_leaves_nothing(sig, corpus, bpe_tokenizer, tmp_path):
    """Before: SIGTERM one second into the build waited for the whole build, then trained a step and saved (37-42 s
    for 928 k pairs; SIGINT: 1.9 s). Now every stop request ends the build within seconds, like Ctrl-C."""
    cache, out = tmp_path / "cache", tmp_path / "run" / "output"
    cmd = launch_cmd(1) + train_flags(corpus, bpe_tokenizer, out, "--steps", 2, cache=cache)
    proc, took = stop_during_build(cmd, cache, tmp_path, sig)
    name = signal.Signals(sig).name
    print(f"{name} during the build: train.py ended {took:.1f} s later (load factor {load_factor():.1f})")
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and lines_of(proc.stderr) == ["interrupted"], proc.stderr[-3000:]
    else:
        assert proc.returncode == 128 + sig, proc.stderr[-3000:]
        assert lines_of(proc.stderr) == [
            f"stopped by {name} while preparing the data, before the first step: "
            f"nothing to save, and nothing half built is left; the same command starts "
            f"again"
        ], proc.stderr[-3000:]
    assert took < scaled(10), f"{took:.1f} s"
    assert left_in(cache) == [], left_in(cache)  # no store, no .tmp-* folder, no lock file
    assert not (tmp_path / "run").exists()  # the output folder it made, and its lock, are gone
    assert not _processes_naming(tmp_path), "processes left behind"


def test_sigterm_to_the_launcher_during_the_build_stops_every_rank_and_a_later_start_builds(
    corpus, bpe_tokenizer, tmp_path
):
    """2 ranks under DeepSpeed's launch.py, which SIGTERMs them one by one: rank 0 (building) stops, tells the other
    through the job's store, and the job ends in one line with nothing left; the same command then builds and
    trains."""
    cache, out = tmp_path / "cache", tmp_path / "output"
    flags = train_flags(corpus, bpe_tokenizer, out, "--steps", 1, "--mp", 2, cache=cache)
    proc, took = stop_during_build(launch_cmd(2, launcher="deepspeed") + flags, cache, tmp_path, signal.SIGTERM)
    print(f"SIGTERM to launch.py during the build: the job ended {took:.1f} s later")
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    said = [line for line in lines_of(proc.stderr) if "[WARNING]" not in line and "[INFO]" not in line]
    assert said == [
        "stopped by SIGTERM while preparing the data, before the first step: nothing to save, and "
        "nothing half built is left; the same command starts again"
    ], proc.stderr[-3000:]
    assert took < scaled(15), f"{took:.1f} s"
    assert left_in(cache) == [] and not out.exists(), left_in(cache)
    assert not _processes_naming(tmp_path), "processes left behind"
    run_train(2, flags, timeout=300)
    assert [r["step"] for r in read_metrics(out)] == [1]


# ---------------------------------------------------------------------------------------------- usage errors
@pytest.mark.parametrize(
    "argv,needle",
    [
        ([], "--file_path is required"),
        (["--file_path", "{tsv}", "--mp", "3", "--output_dir", "runs/a/b"], "invalid parallel layout"),
    ],
    ids=["no arguments", "layout"],
)
def test_a_run_that_ends_in_a_usage_error_creates_nothing(argv, needle, multi30k_tsv, tmp_path, assert_user_error):
    """`dstr-train` with no arguments made ./out/train/.train.lock in the working folder."""
    work = tmp_path / "cwd"
    work.mkdir()
    cmd = [sys.executable, "-m", "training.cli.train", *[a.format(tsv=multi30k_tsv) for a in argv]]
    assert_user_error(run_python(cmd, cwd=work, env=env()), needle)
    assert sorted(work.rglob("*")) == []


def test_a_usage_error_keeps_the_folder_and_lock_file_it_did_not_make(multi30k_tsv, tmp_path, assert_user_error):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".train.lock").write_text("pid 1 on a host since earlier\n")
    proc = run_python(
        [sys.executable, "-m", "training.cli.train", "--file_path", multi30k_tsv, "--output_dir", out, "--mp", "3"],
        env=env(),
    )
    assert_user_error(proc, "invalid parallel layout")
    assert sorted(p.name for p in out.iterdir()) == [".train.lock"]
