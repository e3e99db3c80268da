"""Two jobs on one machine never harm each other (docs/failures.md#jobs-sharing-a-node).

Real 2-rank jobs through DeepSpeed's per-node launcher (tests.launch.launch_cmd(launcher="deepspeed")): a job B
started on the master port of a job A that is training stops in one line, and A trains on exactly as alone; two
jobs on two ports train side by side.
"""
from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.launch import REPO_ROOT, TINY, env, launch_cmd, losses, read_metrics
from tests.multiproc import free_port

STEPS = 400                       # A must still be training when B ends (B takes about 10 s on 2 cores)


@pytest.fixture(autouse=True)
def real_interpreters(monkeypatch):
    """Each job its own interpreters, as two users' jobs are (not forks of the tests' fork server)."""
    monkeypatch.setenv("DSR_TEST_FORK", "0")


def job_args(tsv, tok, out) -> list[str]:
    return [str(a) for a in ["--file_path", tsv, "--tokenizer", tok, "--output_dir", out, *TINY, "--mp", 2,
                             "--steps", STEPS]]


def start(tsv, tok, out: Path, port: int) -> subprocess.Popen:
    out.mkdir(parents=True)
    with open(out.parent / f"{out.name}.stdout", "w") as o, open(out.parent / f"{out.name}.stderr", "w") as e:
        return subprocess.Popen(launch_cmd(2, launcher="deepspeed", port=port) + job_args(tsv, tok, out),
                                cwd=REPO_ROOT, env=env(), stdout=o, stderr=e)


def finish(popen: subprocess.Popen, out: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in psutil.Process(popen.pid).children(recursive=True) + [psutil.Process(popen.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        popen.wait()
        raise AssertionError(f"{out.name} did not end within {timeout} s")
    return subprocess.CompletedProcess(popen.args, popen.returncode, (out.parent / f"{out.name}.stdout").read_text(),
                                       (out.parent / f"{out.name}.stderr").read_text())


def logged_step(out: Path) -> int:
    records = read_metrics(out) if (out / "metrics.jsonl").is_file() else []
    return records[-1]["step"] if records else 0


def test_a_job_on_a_busy_master_port_stops_in_one_line_and_the_running_job_trains_on_unharmed(
        multi30k_tsv, bpe_tokenizer, tmp_path):
    """B on A's port: B's rank 0 cannot serve a store there (one line naming the port; before, torch's
    DistNetworkError traceback), and nothing of B reaches A — not B's supervisors' failure news (before: written into
    A's store, which stopped A, naming B's rank 0), nor B's rank 1, which meets A's store in the rendezvous."""
    port = free_port()
    a = start(multi30k_tsv, bpe_tokenizer, tmp_path / "a", port)
    deadline = time.time() + 240
    while logged_step(tmp_path / "a") < 5:
        assert a.poll() is None, (tmp_path / "a.stderr").read_text()[-3000:]
        assert time.time() < deadline, "A did not start training"
        time.sleep(0.3)
    b = finish(start(multi30k_tsv, bpe_tokenizer, tmp_path / "b", port), tmp_path / "b", timeout=120)
    a_step_when_b_ended = logged_step(tmp_path / "a")
    a_done = finish(a, tmp_path / "a")

    text = b.stdout + b.stderr
    assert b.returncode != 0 and "Traceback" not in text, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: the master port {port} at 127.0.0.1 is in use (another job's rendezvous?): start this "
                      f"job on another port — `deepspeed --master_port N`, or MASTER_PORT=N for mpirun/torchrun "
                      f"(run.sh and run_cluster.sh take a free one when MASTER_PORT is unset)"], text[-4000:]
    assert a_step_when_b_ended < STEPS, "A finished before B ended: raise STEPS so that they overlap"
    assert a_done.returncode == 0, a_done.stderr[-4000:]
    assert "stopping" not in a_done.stderr and "error" not in a_done.stderr, a_done.stderr[-4000:]
    solo = tmp_path / "solo"
    assert finish(start(multi30k_tsv, bpe_tokenizer, solo, free_port()), solo).returncode == 0
    assert losses(tmp_path / "a") == losses(solo) and len(losses(solo)) == STEPS


def test_two_jobs_on_two_ports_train_side_by_side(multi30k_tsv, bpe_tokenizer, tmp_path):
    jobs = [start(multi30k_tsv, bpe_tokenizer, tmp_path / name, free_port()) for name in ("one", "two")]
    done = [finish(job, tmp_path / name) for job, name in zip(jobs, ("one", "two"))]
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-3000:] for d in done]
    assert losses(tmp_path / "one") == losses(tmp_path / "two") and len(losses(tmp_path / "one")) == STEPS
