"""Two jobs on one machine never harm each other (docs/failures.md#jobs-sharing-a-node).

Real 2-rank jobs through DeepSpeed's per-node launcher (tests.launch.launch_cmd(launcher="deepspeed")): two jobs
on two ports train side by side, and a job B started on the master port of one of them stops in one line while
that one trains on exactly as its twin. In-process: the store's rules (a rank's seat; who may write where).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.drivers.spawn_ranks import rank_env
from tests.launch import REPO_ROOT, TRAIN, env, launch_cmd, losses, read_metrics, train_flags
from tests.multiproc import free_port
from tests.progress import scaled, wait_exit, wait_until

STEPS = 400  # A must still be training when B ends (B takes about 10 s on 2 cores)


# each job its own interpreters, as two users' jobs are (not forks of the tests' fork server)
pytestmark = pytest.mark.usefixtures("real_interpreters")


def job_args(tsv, tok, out, steps: int) -> list[str]:
    return [str(a) for a in train_flags(tsv, tok, out, "--mp", 2, "--steps", steps)]


def start(tsv, tok, out: Path, port: int, steps: int = STEPS) -> subprocess.Popen:
    out.mkdir(parents=True)
    with open(out.parent / f"{out.name}.stdout", "w") as o, open(out.parent / f"{out.name}.stderr", "w") as e:
        return subprocess.Popen(
            launch_cmd(2, launcher="deepspeed", port=port) + job_args(tsv, tok, out, steps),
            cwd=REPO_ROOT,
            env=env(),
            stdout=o,
            stderr=e,
        )


def finish(popen: subprocess.Popen, out: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    logs = (out.parent / f"{out.name}.stdout", out.parent / f"{out.name}.stderr")
    wait_exit(popen, timeout, out.name, logs)  # the limit grows with the machine's load (tests/progress)
    return subprocess.CompletedProcess(
        popen.args,
        popen.returncode,
        (out.parent / f"{out.name}.stdout").read_text(),
        (out.parent / f"{out.name}.stderr").read_text(),
    )


def logged_step(out: Path) -> int:
    records = read_metrics(out) if (out / "metrics.jsonl").is_file() else []
    return records[-1]["step"] if records else 0


def test_a_job_on_a_busy_master_port_stops_in_one_line_and_the_jobs_running_train_on_unharmed(
    multi30k_tsv, bpe_tokenizer, tmp_path
):
    """A and a twin of A on two ports at once both finish. B on A's port: B's rank 0 cannot serve a store there (one
    line naming the port; before, torch's DistNetworkError traceback), and nothing of B reaches A — not B's
    supervisors' failure news (before: written into A's store, which stopped A, naming B's rank 0), nor B's rank 1,
    which meets A's store in the rendezvous: A's losses are its twin's, bit for bit."""
    port = free_port()
    a = start(multi30k_tsv, bpe_tokenizer, tmp_path / "a", port)
    twin = start(multi30k_tsv, bpe_tokenizer, tmp_path / "twin", free_port())
    wait_until(
        lambda: logged_step(tmp_path / "a") >= 5,
        a,
        240,
        "A starting to train",
        (tmp_path / "a.stdout", tmp_path / "a.stderr"),
    )
    b = start(multi30k_tsv, bpe_tokenizer, tmp_path / "b", port)
    # B's rank 1 alone, as on a node of its own (no launcher there ends it when B's rank 0 fails): it finds A's
    # store, whose rank 1 seat is taken, and refuses in one line (before: it completed the rendezvous in A's store).
    # It starts beside B (each takes about 15 s here, most of it imports), so both end while A still trains.
    lone = subprocess.Popen(
        [sys.executable, TRAIN, "--local_rank=1", *job_args(multi30k_tsv, bpe_tokenizer, tmp_path / "b1", STEPS)],
        env=rank_env(env(), 1, 2, port),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    b = finish(b, tmp_path / "b", timeout=120)
    out, err = lone.communicate(timeout=scaled(120))
    lone = subprocess.CompletedProcess(lone.args, lone.returncode, out, err)
    a_step_when_b_ended = logged_step(tmp_path / "a")
    a_done, twin_done = finish(a, tmp_path / "a"), finish(twin, tmp_path / "twin")

    text = b.stdout + b.stderr
    assert b.returncode != 0 and "Traceback" not in text, text[-4000:]
    port_in_use = (
        f"error: the master port {port} at 127.0.0.1 is in use (another job's rendezvous?): start this "
        f"job on another port — `deepspeed --master_port N`, or MASTER_PORT=N for mpirun/torchrun "
        f"(run.sh and run_cluster.sh take a free one when MASTER_PORT is unset)"
    )
    store_taken = (
        f"error: the store at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} belongs to another job (its rank 1 "
        f"joined it before this one): start this job on another port — `deepspeed --master_port N`, or "
        f"MASTER_PORT=N"
    )
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    # B's rank 0 names the port; B's rank 1 may also reach A's store before the launcher ends it (a race the CI's
    # run lost once), and then says so in its own line: either way, one line per rank and nothing else.
    assert port_in_use in errors and set(errors) <= {port_in_use, store_taken} and len(errors) <= 2, text[-4000:]
    assert lone.returncode == 2 and "Traceback" not in lone.stderr, lone.stderr[-4000:]
    assert [line for line in lone.stderr.splitlines() if line.startswith("error: ")] == [store_taken]
    assert a_step_when_b_ended < STEPS, "A finished before B ended: raise STEPS so that they overlap"
    assert [a_done.returncode, twin_done.returncode] == [0, 0], a_done.stderr[-3000:] + twin_done.stderr[-3000:]
    assert "stopping" not in a_done.stderr and "error" not in a_done.stderr, a_done.stderr[-4000:]
    assert losses(tmp_path / "a") == losses(tmp_path / "twin") and len(losses(tmp_path / "a")) == STEPS


@pytest.fixture
def fresh_job_store(monkeypatch):
    """training.core.job_store as in a new process (its state is per process), MASTER_* naming a free port."""
    from training.core import job_store

    for name in ("_job", "_pending", "_server"):
        monkeypatch.setattr(job_store, name, None)
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for key in ("DSR_LAUNCH_ID", "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    return job_store, port


def test_a_rank_takes_its_seat_once_and_another_jobs_rank_is_refused_without_a_write(fresh_job_store, monkeypatch):
    from common.errors import UserError

    job_store, port = fresh_job_store
    job = job_store.create("127.0.0.1", port, 10)  # A's rank 0
    monkeypatch.setattr(job_store, "_job", None)  # A's rank 1 (state is per process)
    job_store.check_before_rendezvous("127.0.0.1", port, 1, 10)  # takes its seat
    assert job_store.join("127.0.0.1", port, 10) == job
    seat = job_store.client("127.0.0.1", port, 5).get(f"{job_store.SEAT_KEY}1")
    monkeypatch.setattr(job_store, "_job", None)  # B's rank 1
    with pytest.raises(UserError, match=f"127.0.0.1:{port} belongs to another job \\(its rank 1 joined it before"):
        job_store.check_before_rendezvous("127.0.0.1", port, 1, 10)
    assert job_store.client("127.0.0.1", port, 5).get(f"{job_store.SEAT_KEY}1") == seat


def test_supervisors_write_only_into_their_own_jobs_store(fresh_job_store, monkeypatch):
    """A rank that never joined (rank 0 or not, no launcher id) writes nothing into the store it finds; a joined one
    only into its job's; with a launcher id an unjoined rank reports to the store of its own launch only."""
    from training.run import job_watch

    job_store, port = fresh_job_store
    job = job_store.create("127.0.0.1", port, 10)
    store = job_store.client("127.0.0.1", port, 5)
    assert not job_watch.publish_abort("B's rank 0 failed", 0, 2, None, patience=1)
    assert not job_watch.publish_abort("B's rank 1 failed", 1, 2, None, patience=1)
    assert not job_watch.publish_abort("a rank of job X failed", 1, 2, "X" * 32, patience=1)
    job_watch.publish_stopped(1, "B's rank 1 was stopped", None)
    assert not store.check([job_watch.ABORT]) and not store.check([f"{job_watch.STOPPED}1"])
    monkeypatch.setenv("DSR_LAUNCH_ID", "another-launch")
    assert not job_watch.publish_abort("rank 1 of another launch failed", 1, 2, None, patience=1)
    assert not store.check([job_watch.ABORT])
    # the default patience: on a loaded machine (the suite's other worker, other jobs) a connection took over 5 s
    assert job_watch.publish_abort("rank 1 (pid 7 on vm) failed: its own line", 1, 2, job)
    assert store.get(job_watch.ABORT) == b"rank 1 (pid 7 on vm) failed: its own line"


def _launch_lookalike(cmdline: str) -> subprocess.Popen:
    """A process whose command line reads `cmdline` (what pkill -f matches), doing nothing."""
    return subprocess.Popen(["bash", "-c", f'exec -a "{cmdline}" sleep 600'])


def test_stopping_a_multinode_run_ends_its_own_launchers_and_no_other_jobs():
    """DeepSpeed's pdsh runner, stopped, runs `pkill -f "<python> -u -m deepspeed.launcher.launch"` on every node:
    that ends any other DeepSpeed job started there by the same interpreter. run_cluster.sh's runner
    (training.run.launcher) narrows the pattern to this job's --world_info, --master_addr and --master_port. The
    commands are DeepSpeed's own (PDSHRunner.get_cmd), and the pattern goes through a shell as pdsh sends it."""
    import shlex

    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import parse_args

    from training.run.launcher import job_kill_command

    args = parse_args(["--master_addr", "10.1.2.3", "--master_port", "29555", "train.py", "--steps", "5"])
    cmd, kill_cmd, _ = PDSHRunner(args, "eyJob3N0QSI6IFswXX0+=").get_cmd(
        dict(os.environ), {"hostA": [0, 1], "hostB": [0, 1]}
    )
    ours = job_kill_command(kill_cmd, cmd)
    assert ours[:-2] == kill_cmd[:-2] and ours[-2] == "pkill -f"  # pdsh's arguments unchanged
    launch = f"{sys.executable} -u -m deepspeed.launcher.launch"
    job = "--master_addr=10.1.2.3 --master_port=29555 --enable_each_rank_log=/x train.py --steps 5"
    mine = [_launch_lookalike(f"{launch} --world_info=eyJob3N0QSI6IFswXX0+= --node_rank={n} {job}") for n in (0, 1)]
    others = [
        _launch_lookalike(
            f"{launch} --world_info=eyJob3N0QSI6IFswXX0+= --node_rank=0 "
            f"--master_addr=10.1.2.3 --master_port=29556 train.py"
        ),  # another port
        _launch_lookalike(
            f"{launch} --world_info=b3RoZXI= --node_rank=0 --master_addr=10.1.2.3 --master_port=29555 train.py"
        ),
    ]  # another job's hosts
    try:
        time.sleep(0.5)
        subprocess.run(["bash", "-c", " ".join(ours[-2:])], timeout=scaled(30))  # as the node's shell runs it
        for p in mine:
            p.wait(timeout=scaled(10))
        assert all(p.poll() is None for p in others), "another job's launcher was ended"
        # DeepSpeed's own pattern would have ended them all
        assert shlex.split(" ".join(kill_cmd[-2:]))[-1].replace("\\", "") in f"{launch} --world_info"
    finally:
        for p in mine + others:
            p.kill()
            p.wait()
