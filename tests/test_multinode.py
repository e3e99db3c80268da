"""Several nodes for real: run_cluster.sh on a virtual cluster of 2 nodes × 2 ranks (tests/cluster: network
namespaces, an sshd per node), through DeepSpeed's pdsh runner and through OpenMPI's mpirun, gloo over the nodes'
network — the paths a user takes with a hostfile, with nothing stood in.

- parity: dp2×tp2 over pdsh and dp2×pp2 over mpirun train like one process (loss within 1e-5 relative, fp32,
  dropout 0), each saving at step 3; a second launch resumes from it and repeats steps 4-6 bit for bit;
- the pdsh run reads its data from, and writes its run folder under, paths full of spaces, quotes, `$(...)`,
  backticks and `$HOME` (a BOM + CRLF hostfile too): it trains normally and no command in them runs;
- failures that cross nodes end the whole job, with one line naming the rank, its node, pid and signal: a rank
  killed on node 1 (within 30 s), a busy output folder refused by rank 0 on node 0 (node 1's ranks end within 30 s),
  a rank paused on node 1 (after --comm_timeout), an output folder node 1 does not share (before any step);
- SIGTERM to the deepspeed launcher on node 0: every rank finishes its step and the job saves it and says so;
- after every job, nothing is left running on any node.

The cluster needs root and network namespaces (and sshd, pdsh, OpenMPI, installed by the README's test command);
elsewhere these tests skip with the reason. Each launch costs 20-40 s on 2 cores (8 Python processes start).
"""

from __future__ import annotations

import fcntl
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import VirtualCluster, unavailable
from tests.launch import REPO_ROOT, TINY, only_launch, only_run_dir, read_metrics, run_train, script_env
from tests.progress import scaled

CLUSTER_SH = REPO_ROOT / "run_scripts" / "run_cluster.sh"
RECIPE = REPO_ROOT / "recipes" / "cpu-tiny" / "cpu-tiny.json"
STEPS = 6
FLAGS = [*TINY, "--steps", STEPS, "--save_checkpoint_steps", 3, "--log_interval", 1]
DPxTP = ["--mp", 2]
DPxPP = ["--mp", 1, "--pipeline_stage", 2, "--micro_batch_num", 2]
ENDS_WITHIN = 30.0

_why_not = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why_not is not None, reason=f"virtual cluster: {_why_not}")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    vc = VirtualCluster(tmp_path_factory.mktemp("cluster")).up(2, slots=2)
    try:
        yield vc
    finally:
        vc.down()
        gone = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert vc.env["PREFIX"] not in gone, f"namespaces left behind: {gone}"


@pytest.fixture(scope="module")
def data(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    """2,000 Multi30k pairs in a folder whose path a shell would run commands from, and the BPE tokenizer."""
    root = tmp_path_factory.mktemp("paths")
    marker = root / "PWNED"
    weird = root / f"data dir 'q' \"dq\" $(touch {marker}) `touch {marker}2` $HOME ;x"
    weird.mkdir(parents=True)
    tsv = weird / "train.fr_en.tsv"
    with open(multi30k_tsv, encoding="utf-8") as src, open(tsv, "w", encoding="utf-8") as dst:
        for _, line in zip(range(2000), src):
            dst.write(line)
    return {"tsv": tsv, "tokenizer": bpe_tokenizer, "root": root, "marker": marker}


def launch(cluster, data, runs_dir, *flags, launcher="pdsh", wait=True, **env):
    """bash run_cluster.sh DATA HOSTFILE RECIPE FLAGS on node 0 of the cluster (as a user logged in there)."""
    cmd = [
        "bash",
        CLUSTER_SH,
        data["tsv"],
        cluster.hostfile,
        RECIPE,
        *map(str, FLAGS),
        "--tokenizer",
        data["tokenizer"],
        *map(str, flags),
    ]
    extra = {"LAUNCHER": "openmpi", "LAUNCHER_ARGS": "--allow-run-as-root"} if launcher == "openmpi" else {}
    # DEEPSPEED unset: run_cluster.sh's own runner (training.run.launcher), as a user gets it
    e = script_env(runs_dir, **{"DEEPSPEED": "", **extra, **env})
    args = dict(cwd=REPO_ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cluster.command(0, cmd), **args)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=scaled(300))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def serial_losses(data, tmp_path, *layout_flags) -> list[float]:
    """The same run in one process (the parity reference)."""
    out = tmp_path / "serial"
    run_train(
        1,
        [
            "--recipe",
            RECIPE,
            *FLAGS,
            "--mp",
            1,
            "--pipeline_stage",
            1,
            *layout_flags,
            "--file_path",
            data["tsv"],
            "--tokenizer",
            data["tokenizer"],
            "--output_dir",
            out,
        ],
    )
    return [r["loss"] for r in read_metrics(out)]


def assert_nothing_left(cluster, deadline: float = 40.0):
    end = time.monotonic() + scaled(deadline)
    while cluster.leftovers() and time.monotonic() < end:
        time.sleep(0.5)
    assert not cluster.leftovers(), f"still running on the nodes: {cluster.leftovers()}"


def wait_for_step(runs: Path, step: int, proc, timeout: float = 180.0) -> tuple[Path, int]:
    """(the job's run folder, the last step logged) once its metrics reach `step`."""
    end = time.monotonic() + scaled(timeout)
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early:\n{proc.stdout.read()}\n{proc.stderr.read()}")
        metrics = list(Path(runs).glob("*/output/metrics.jsonl"))
        if metrics:
            records = read_metrics(metrics[0].parent)
            if records and records[-1]["step"] >= step:
                return metrics[0].parent.parent, records[-1]["step"]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


def ended_within(proc, seconds: float) -> tuple[float, str, str]:
    """(seconds taken, stdout, stderr) of a job that ends within `seconds` on an idle machine (the limit grows with
    the load, tests/progress.py)."""
    start, limit = time.monotonic(), scaled(seconds)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the job was still running {limit:.0f} s later:\n{out[-3000:]}\n{err[-3000:]}") from None
    return time.monotonic() - start, out, err


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=tol)


def max_rel(got: list, want: list) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


# ------------------------------------------------------------------------------------------------ parity, resume
def test_pdsh_dp2_tp2_over_two_nodes_equals_one_process_resumes_exactly_and_runs_no_path(cluster, data, tmp_path):
    hostfile = cluster.root / "hostfile-windows"  # as written by a Windows editor
    hostfile.write_bytes(
        ("\ufeff# two virtual nodes\r\n" + cluster.hostfile.read_text().replace("\n", "\r\n")).encode("utf-8")
    )
    runs = data["root"] / "runs $(touch PWNED3) `id` 'it''s'"
    proc = launch(cluster, data, runs, *DPxTP)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(runs)
    logs = sorted(p.name for p in only_launch(run_dir).glob("*_rank*.log"))
    assert logs == ["vnode0_rank0.log", "vnode0_rank1.log", "vnode1_rank2.log", "vnode1_rank3.log"]
    got = [r["loss"] for r in read_metrics(run_dir / "output")]
    want = serial_losses(data, tmp_path)
    assert len(got) == STEPS and all(close(g, w) for g, w in zip(got, want)), (got, want)
    print(f"pdsh dp2xtp2: max relative loss difference to one process {max_rel(got, want):.1e}")
    ran = [
        p
        for p in (
            data["marker"],
            Path(f"{data['marker']}2"),
            REPO_ROOT / "PWNED3",
            Path(os.path.expanduser("~/PWNED3")),
            Path("/PWNED3"),
        )
        if p.exists()
    ]
    assert not ran, f"a command in a path ran: {ran}"

    # resume on the cluster from step 3 into a new folder: steps 4-6 repeat bit for bit
    resumed = runs / "resumed"
    proc = launch(
        cluster,
        data,
        runs / "again",
        *DPxTP,
        "--resume",
        run_dir / "output/checkpoints/step_00000003",
        "--output_dir",
        resumed,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [4, 5, 6] and [r["loss"] for r in again] == got[3:]
    assert_nothing_left(cluster)


def test_openmpi_dp2_pp2_over_two_nodes_equals_one_process_and_resumes_exactly(cluster, data, tmp_path):
    runs = tmp_path / "runs"
    proc = launch(cluster, data, runs, *DPxPP, launcher="openmpi")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(runs)
    logs = sorted(p.name for p in only_launch(run_dir).glob("*_rank*.log"))
    assert logs == ["vnode0_rank0.log", "vnode0_rank1.log", "vnode1_rank2.log", "vnode1_rank3.log"]
    got = [r["loss"] for r in read_metrics(run_dir / "output")]
    want = serial_losses(data, tmp_path, "--pipeline_stage", 1, "--micro_batch_num", 2)
    assert len(got) == STEPS and all(close(g, w) for g, w in zip(got, want)), (got, want)
    print(f"mpirun dp2xpp2: max relative loss difference to one process {max_rel(got, want):.1e}")
    resumed = tmp_path / "resumed"
    proc = launch(
        cluster,
        data,
        tmp_path / "runs2",
        *DPxPP,
        "--resume",
        run_dir / "output/checkpoints/step_00000003",
        "--output_dir",
        resumed,
        launcher="openmpi",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(resumed)] == got[3:]
    assert_nothing_left(cluster)


# ------------------------------------------------------------------------------------------------ failures
LONG = ["--steps", 100000, "--save_checkpoint_steps", 0]


def test_a_rank_killed_on_node_1_ends_the_job_naming_it(cluster, data, tmp_path):
    runs = tmp_path / "runs"
    proc = launch(cluster, data, runs, *DPxTP, *LONG, wait=False)
    wait_for_step(runs, 2, proc)
    pid = cluster.ranks(1)[3]
    os.kill(pid, signal.SIGKILL)
    took, out, err = ended_within(proc, ENDS_WITHIN)
    assert proc.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: rank 3 (pid {pid} on vnode1) was killed by SIGKILL (kill -9, or the kernel's "
        f"out-of-memory killer: see `dmesg`); the job stops"
    ], err
    print(f"kill -9 of rank 3 on node 1: the job ended {took:.1f} s later")
    assert_nothing_left(cluster)


def test_a_refusal_by_rank_0_on_node_0_ends_node_1s_ranks(cluster, data, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    with open(busy / ".train.lock", "w") as lock:  # another run holds the folder
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        start = time.monotonic()
        proc = launch(cluster, data, tmp_path / "runs", *DPxTP, *LONG, "--output_dir", busy, wait=False)
        # without the refusal reaching node 1, its ranks would wait for rank 0 until --comm_timeout (1800 s)
        took, out, err = ended_within(proc, 150)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert any(line.startswith("error: --output_dir") and "is in use" in line for line in err.splitlines()), err
    rank_logs = {p.name: p.read_text() for p in only_launch(only_run_dir(tmp_path / "runs")).glob("vnode1_rank*.log")}
    # node 1's ranks heard rank 0's refusal: the first to hear it names it and exits, and node 1's launcher then ends
    # its sibling, which may go before its own watcher prints the same line (seen once in a full run)
    assert len(rank_logs) == 2 and any("stopping: rank 0 (pid" in t for t in rank_logs.values()), rank_logs
    print(f"busy output folder on node 0: the whole job ended {took:.1f} s after its launch")
    # no bound tighter than ended_within's: the launch itself (8 Python processes on 2 cores) takes most of the time,
    # 30-40 s alone and 88 s with two training jobs beside the suite
    assert_nothing_left(cluster)


def test_a_paused_rank_on_node_1_ends_the_job_after_comm_timeout_naming_it(cluster, data, tmp_path):
    runs = tmp_path / "runs"
    timeout = 15
    proc = launch(cluster, data, runs, *DPxTP, *LONG, "--comm_timeout", timeout, wait=False)
    wait_for_step(runs, 2, proc)
    pid = cluster.ranks(1)[3]
    os.kill(pid, signal.SIGSTOP)
    took, out, err = ended_within(proc, timeout + ENDS_WITHIN)
    assert proc.returncode != 0
    assert f"rank 3 (pid {pid} on vnode1) was stopped by SIGSTOP" in err, err
    assert f"within --comm_timeout {timeout} s" in err, err
    print(f"SIGSTOP of rank 3 on node 1 (--comm_timeout {timeout}): the job ended {took:.1f} s later")
    assert_nothing_left(cluster)


def test_an_output_folder_node_1_does_not_share_is_refused_before_training(cluster, data, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    # node 1 sees another folder under the same path (a node-local disk where the others mount NFS)
    mount = cluster.command(1, ["mount", "-t", "tmpfs", "tmpfs", runs])
    subprocess.run(mount, check=True, timeout=scaled(30))
    try:
        proc = launch(cluster, data, runs, *DPxTP, *LONG)
    finally:
        subprocess.run(cluster.command(1, ["umount", runs]), timeout=scaled(30))
    assert proc.returncode != 0
    errors = sorted({line for line in proc.stderr.splitlines() if line.startswith("error: ")})
    assert len(errors) == 1 and "is not the same folder on every node: vnode1 (ranks 2, 3) do not see" in errors[0]
    assert not (only_run_dir(runs) / "output" / "metrics.jsonl").exists()  # not one step
    assert_nothing_left(cluster)


# ------------------------------------------------------------------------------------------------ preemption
def test_sigterm_to_the_launcher_on_node_0_saves_the_step_on_every_node(cluster, data, tmp_path):
    runs = tmp_path / "runs"
    proc = launch(cluster, data, runs, *DPxTP, *LONG, "--log_interval", 1, wait=False)
    run_dir, at = wait_for_step(runs, 2, proc)
    output = run_dir / "output"
    runner = [pid for pid, cmdline, _ in cluster.processes(0) if "training.run.launcher" in cmdline]
    assert len(runner) == 1
    # another job's DeepSpeed launch on the same nodes (the virtual nodes share this machine's processes), started
    # by the same interpreter: DeepSpeed's runner would end it too (its pkill pattern matches every launch)
    other = subprocess.Popen(
        [
            "bash",
            "-c",
            f'exec -a "{sys.executable} -u -m deepspeed.launcher.launch '
            f"--world_info=b3RoZXI= --node_rank=0 --master_addr=10.9.9.9 --master_port=29500 "
            f'train.py" sleep 600',
        ]
    )
    try:
        os.kill(runner[0], signal.SIGTERM)
        took, out, err = ended_within(proc, ENDS_WITHIN + 30)
        assert other.poll() is None, "the SIGTERM'd job's launcher ended another job's launch"
    finally:
        other.kill()
        other.wait()
    assert_nothing_left(cluster)
    assert proc.returncode != 0
    rank0 = (only_launch(only_run_dir(runs)) / "vnode0_rank0.log").read_text()
    stopped = [line for line in rank0.splitlines() if line.startswith("stopped by SIGTERM at step ")]
    assert len(stopped) == 1, rank0[-3000:]
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert stopped[0] == f"stopped by SIGTERM at step {step}; checkpoint step_{step:08d} saved; resume with --resume"
    # the runner's SIGTERM reaches the ranks through pdsh (pkill over ssh on each node) a few steps later
    assert at <= step and (output / "checkpoints" / f"step_{step:08d}" / "meta.json").exists()
    assert read_metrics(output)[-1]["step"] == step  # no step after the saved one
    print(f"SIGTERM to the launcher at step {at}: step {step} saved, the job ended {took:.1f} s later")
