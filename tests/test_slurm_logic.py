"""The SLURM pieces that need no cluster (tests/test_slurm.py runs them on one): what srun's variables mean to a rank
(common/slurm.py), whether a chain of jobs goes on (training/run/slurm_chain.py), each launch in run.json
(training/run/launch_record.py), plan.py --slurm's line (training/plan/slurm_line.py), and slurm.sbatch's refusals
outside a job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from common import slurm
from common.errors import UserError
from tests.launch import REPO_ROOT
from tests.progress import scaled
from training.run import launch_record, slurm_chain

SBATCH = REPO_ROOT / "run_scripts" / "slurm.sbatch"
TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}


# ------------------------------------------------------------------------------------------------ srun's variables
@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu[07-09,12],login1", "gpu07"),
        ("node3", "node3"),
        ("node3,node4", "node3"),
        ("rack[2-3]-n[1-4]", "rack2-n1"),
        ("vnode[0-1]", "vnode0"),
    ],
)
def test_the_first_host_of_a_host_list(nodelist, first):
    assert slurm.first_host(nodelist) == first


def test_tasks_per_node_and_bad_specs():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(UserError, match="SLURM_STEP_TASKS_PER_NODE"):
        slurm.tasks_per_node("2(x")


def test_the_job_port_is_derived_from_the_job_id_and_skips_busy_ports_and_29500():
    def free(port):  # this machine's own ports are not the subject: other jobs hold some (29501-29503 beside
        return True  # tests/load/jobs_beside.sh's four jobs)

    assert slurm.job_port(12, free=free) == 20012
    assert slurm.job_port(12, free=lambda port: port != 20012) == 20013
    assert slurm.job_port(9500, free=free) == 29501  # 29500: torch's default, skipped even where it is free
    assert slurm.job_port(20012, free=free) == 20012  # (the span wraps)
    with socket.socket() as held:  # by default, a port something listens on here is skipped
        for job in range(100, 200):  # the first of the job ports that nothing else holds now
            with contextlib.suppress(OSError):
                held.bind(("", slurm.job_port(job)))
                break
        else:
            pytest.fail("every port job_port chose for jobs 100-199 was taken before the test could hold it")
        held.listen()
        assert slurm.job_port(job) != held.getsockname()[1]


def test_a_task_of_an_srun_step_gets_torchs_variables():
    env = dict(TASK)
    assert slurm.adopt(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "24242",
    }
    given = dict(TASK, MASTER_ADDR="10.0.0.1", MASTER_PORT="23456")  # the batch script's win
    slurm.adopt(given)
    assert (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("10.0.0.1", "23456")


def test_the_batch_shell_and_other_launchers_are_left_alone():
    batch = {k: v for k, v in TASK.items() if not k.startswith("SLURM_STEP")}  # sbatch's shell: no step
    assert not slurm.adopt(batch) and "RANK" not in batch
    launched = dict(TASK, WORLD_SIZE="8", RANK="5")  # deepspeed/torchrun inside an allocation
    assert not slurm.adopt(launched) and launched["RANK"] == "5"


def test_master_outside_a_job_is_one_line(run_module, assert_user_error):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "common.slurm", "master"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert_user_error(proc, "not inside a SLURM job")


# ------------------------------------------------------------------------------------------------ go on or not
RUNNING = {"JobState": "RUNNING", "Reason": "None", "BatchFlag": "1"}
STOPPED = {"launch_id": "L", "end": {"status": "stopped", "step": 437, "by": "SIGUSR1", "checkpoint": "step_00000437"}}


@pytest.mark.parametrize(
    "launch, status, signal, job, restarts, requeue, says",
    [
        (STOPPED, 138, "USR1", RUNNING, 0, True, "requeueing job (restart 1 of at most 20)"),
        (STOPPED, 138, None, RUNNING, 3, True, "stopped by SIGUSR1 at step 437, checkpoint step_00000437 saved"),
        (STOPPED, 143, "TERM", {"JobState": "COMPLETING", "Reason": "TimeLimit"}, 0, True, "at its time limit"),
        (STOPPED, 143, "TERM", {"JobState": "COMPLETING", "Reason": "None"}, 0, False, "the job was cancelled"),
        (STOPPED, 138, "USR1", RUNNING, 20, False, "requeued 20 times, --max_requeues 20"),
        (STOPPED, 138, "USR1", dict(RUNNING, BatchFlag="0"), 0, False, "not a batch job"),
        (
            {"launch_id": "L", "end": {"status": "finished", "step": 60}},
            0,
            None,
            RUNNING,
            0,
            False,
            "training finished",
        ),
        ({"launch_id": "L"}, 2, None, RUNNING, 0, False, "training failed (srun exit status 2): no requeue"),
        ({"launch_id": "L"}, 138, "USR1", RUNNING, 0, False, "training failed"),  # started, then no save: not ours
        (None, 138, None, RUNNING, 0, True, "stopped by SIGUSR1 before its first step"),
        (None, 0, "TERM", RUNNING, 0, True, "stopped by SIGTERM before its first step"),
        (None, 1, None, RUNNING, 0, False, "training failed"),
        (
            {"launch_id": "L"},
            3,
            None,
            {"JobState": "COMPLETING", "Reason": "NodeDown"},
            0,
            False,
            "a node of the job was lost (COMPLETING NodeDown): SLURM requeues the job itself",
        ),
    ],
)
def test_the_chain_goes_on_only_after_a_stop_that_meant_to_go_on(launch, status, signal, job, restarts, requeue, says):
    decision = slurm_chain.decide(launch, status, signal, job, restarts, 20)
    assert decision.requeue == requeue and says in decision.line, decision
    if not requeue and launch and launch.get("end", {}).get("status") == "finished":
        assert decision.exit_status == 0
    elif not requeue:
        assert decision.exit_status != 0


def test_no_requeue_after_two_launches_in_a_row_that_trained_no_step(tmp_path):
    """Seen beside four other jobs: --time=2 --signal=B:USR1@45, and the ranks took longer to start than the notice
    (SLURM sends it up to 60 s early) — 18 requeues in a row each stopped before the first step, until
    --max_requeues. One such launch may be a preemption's notice (requeued); two in a row end the chain."""
    from training.run import launch_record

    idle = {"launch_id": "L", "start_step": 20, "end": {"status": "stopped", "step": 20, "by": "SIGUSR1"}}
    assert not slurm_chain.trained_a_step(None) and not slurm_chain.trained_a_step(idle)
    assert slurm_chain.trained_a_step(STOPPED) and slurm_chain.trained_a_step(dict(idle, end={"step": 21}))
    once = slurm_chain.decide(None, 138, "USR1", RUNNING, 2, 20, previous_trained=True)
    assert once.requeue, once
    for launch in (None, idle):
        twice = slurm_chain.decide(launch, 138, "USR1", RUNNING, 2, 20, previous_trained=False)
        assert not twice.requeue and twice.exit_status != 0, twice
        assert "so was this job's previous launch" in twice.line and "longer --time" in twice.line, twice
    # the previous launch is found in run.json by the job id and restart count the launches recorded
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3", "DSR_LAUNCH_ID": "L3"}
    record = launch_record.this_launch(20, env)
    (tmp_path / "run.json").write_text(json.dumps({"launches": [dict(record, end={"status": "stopped", "step": 20})]}))
    assert slurm_chain.launch_of_restart(str(tmp_path), "7", 3)["launch_id"] == "L3"
    assert slurm_chain.launch_of_restart(str(tmp_path), "7", 2) is None
    assert slurm_chain.launch_of_restart(str(tmp_path), "8", 3) is None
    assert slurm_chain.launch_of_restart(str(tmp_path / "none"), "7", 3) is None


def test_this_launch_is_found_by_its_id(tmp_path):
    (tmp_path / "run.json").write_text(
        json.dumps({"launches": [{"launch_id": "A", "end": {"status": "stopped"}}, {"launch_id": "B"}]})
    )
    assert slurm_chain.this_launch(str(tmp_path), "A")["end"]["status"] == "stopped"
    assert slurm_chain.this_launch(str(tmp_path), "C") is None
    assert slurm_chain.this_launch(str(tmp_path / "none"), "A") is None


def test_a_bad_max_requeues_is_one_line(run_module, assert_user_error):
    assert_user_error(run_module("training.run.slurm_chain", "--check", "--max_requeues", "-1"), "--max_requeues")


# ------------------------------------------------------------------------------------------------ run.json
def test_each_launch_is_recorded_with_its_slurm_job(tmp_path):
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "vnode[0-1]", "DSR_LAUNCH_ID": "one"}
    first = launch_record.launches(str(tmp_path), 0, False, env)
    assert first[0]["slurm"] == {"job_id": 77, "nodes": "vnode[0-1]", "restart_count": 0}
    launch_record.ended(first[0], "stopped", 40, by="SIGUSR1", checkpoint="step_00000040")
    (tmp_path / "run.json").write_text(json.dumps({"launches": first}))
    second = launch_record.launches(str(tmp_path), 40, True, dict(env, SLURM_RESTART_COUNT="1", DSR_LAUNCH_ID="two"))
    assert [(x["launch_id"], x["slurm"]["restart_count"], x["start_step"]) for x in second] == [
        ("one", 0, 0),
        ("two", 1, 40),
    ]
    assert launch_record.launches(str(tmp_path), 0, False, {})[0].keys() >= {"launch_id", "started", "start_step"}
    assert len(launch_record.launches(str(tmp_path), 0, False, {})) == 1  # a fresh start: a new list


# ------------------------------------------------------------------------------------------------ plan.py --slurm
def test_plan_prints_the_sbatch_line_for_a_layout(run_module):
    proc = run_module("training.cli.plan", "--recipe", REPO_ROOT / "recipes/16pcs/16pcs.json", "--slurm")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == (
        "sbatch -N 2 --ntasks-per-node=8 --gpus-per-node=8 --signal=B:USR1@60 "
        "run_scripts/slurm.sbatch DATA_PATH " + str(REPO_ROOT / "recipes/16pcs/16pcs.json")
    ), lines
    assert any("time limit: add --time=" in line for line in lines), lines


def test_plan_sizes_the_lead_from_the_save_and_places_an_uneven_world(run_module):
    proc = run_module(
        "training.cli.plan",
        "--recipe",
        REPO_ROOT / "recipes/16pcs/16pcs.json",
        "--slurm",
        "--json",
        "--world_size",
        12,
        "--mp",
        4,
        "--pipeline_stage",
        1,
        "--batch_size",
        36,
        "--save_GB_s",
        0.01,
    )
    assert proc.returncode == 0, proc.stderr
    sec = json.loads(proc.stdout)["slurm"]
    assert (sec["nodes"], sec["tasks_per_node"]) == (2, 6) and "-N 2 --ntasks-per-node=6 " in sec["sbatch"]
    want = max(60, -(-(2 * sec["save_s"] + 2 * sec["step_s"] + 30) // 10) * 10)
    assert sec["signal_lead_s"] == want and want > 60, sec  # 100× slower storage: a longer lead


def test_plan_refuses_a_zero_save_bandwidth(run_module, assert_user_error):
    assert_user_error(
        run_module(
            "training.cli.plan", "--recipe", REPO_ROOT / "recipes/16pcs/16pcs.json", "--slurm", "--save_GB_s", 0
        ),
        "--save_GB_s",
    )


# ------------------------------------------------------------------------------------------------ the script
def _outside_slurm() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def test_the_batch_script_outside_a_job_is_one_line(tmp_path, assert_user_error):
    data = tmp_path / "train.tsv"
    data.write_text("a\tb\n")
    proc = subprocess.run(
        ["bash", SBATCH, data, REPO_ROOT / "recipes/cpu-tiny/cpu-tiny.json"],
        cwd=tmp_path,
        env=_outside_slurm(),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert_user_error(proc, "not inside a SLURM job", "sbatch")


def test_the_batch_script_says_its_usage_and_its_sbatch_defaults():
    proc = subprocess.run(
        ["bash", SBATCH, "--help"], env=_outside_slurm(), capture_output=True, text=True, timeout=scaled(60)
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: sbatch"), proc.stdout + proc.stderr
    head = SBATCH.read_text().splitlines()
    defaults = [
        line
        for line in head[: head.index(next(x for x in head[1:] if not x.startswith("#SBATCH")))]
        if line.startswith("#SBATCH")
    ]
    assert defaults == ["#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"]


# ------------------------------------------------------------------------------------------------ a lost node
def test_a_survivor_names_the_node_and_ranks_of_a_peer_that_vanished():
    from common.ranks import note_rank_hosts
    from training.run.rank_supervisor import _lost_peer

    note_rank_hosts(["vnode0", "vnode0", "localhost", "localhost"])  # as the job gathered them
    try:
        gloo = "[pair.cc:553] Connection closed by peer [127.0.0.1]:50365. This is typically caused by a remote worker"
        assert _lost_peer(gloo) == ("node localhost (ranks 2, 3)", [2, 3])
        # the other wording gloo uses (seen on the virtual SLURM cluster when a node's ranks were killed at once)
        reset = (
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:55487: "
            "Connection reset by peer. This is typically caused by a r"
        )
        assert _lost_peer(reset) == ("node localhost (ranks 2, 3)", [2, 3])
        assert _lost_peer("Connection reset by peer") == ("another rank", [])
    finally:
        note_rank_hosts([])


def _store_clients(port: int, ranks) -> dict:
    """A JobWatch per rank, each with its own client of the store at `port` (its thread not started)."""
    import datetime

    from torch.distributed import TCPStore

    from training.run.job_watch import JobWatch

    watches = {rank: JobWatch(rank, 4, ("127.0.0.1", port)) for rank in ranks}
    for watch in watches.values():
        watch.store = TCPStore("127.0.0.1", port, timeout=datetime.timedelta(seconds=5))
    return watches


NODE1_CLOSED = "[pair.cc:553] Connection closed by peer [127.0.0.2]:50365. This is typically caused by a remote"
RANK1_CLOSED = "[pair.cc:553] Connection closed by peer [127.0.0.1]:41002. This is typically caused by a remote"


def test_a_survivor_waiting_on_a_survivor_names_the_node_that_was_lost_first():
    """Two nodes, dp2×tp2: node 1 (ranks 2, 3) vanishes; rank 1 sees it at once and ends; rank 0, waiting on rank 1
    in their tensor-parallel collective, then sees rank 1's connection close. Rank 0 names node 1, from what rank 1
    recorded in the job's store (seen once in a full run: rank 0 named its own node, "it ended first")."""
    import datetime

    from torch.distributed import TCPStore

    from common.ranks import note_rank_hosts
    from tests.multiproc import free_port
    from training.run.rank_supervisor import lost_peer_line

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5))
    watches = _store_clients(port, (0, 1))
    note_rank_hosts(["localhost", "localhost", "127.0.0.2", "127.0.0.2"])  # node 0 and node 1, as gathered
    try:
        # without rank 1's record, rank 0 blames rank 1's node (its own): the flaw
        assert lost_peer_line(0, RANK1_CLOSED, None).startswith("rank 0: node localhost (ranks 0, 1) closed")
        rank1 = lost_peer_line(1, NODE1_CLOSED, watches[1])
        assert rank1.startswith("rank 1: node 127.0.0.2 (ranks 2, 3) closed its connection ([pair.cc"), rank1
        rank0 = lost_peer_line(0, RANK1_CLOSED, watches[0])
        assert rank0.startswith(
            "rank 0: node 127.0.0.2 (ranks 2, 3) closed its connection (rank 1 saw it close; then node localhost "
            "(ranks 0, 1) closed its connection here: [pair.cc:553] Connection closed by peer [127.0.0.1]:41002."
        ), rank0
        # and rank 0 records what it named, for a third survivor waiting on it
        assert watches[1].losses_seen_by([0, 2, 3]) == {0: "node 127.0.0.2 (ranks 2, 3)"}
        # one node (rank 3 killed): every survivor names the same node, and the line says it once
        note_rank_hosts(["localhost"] * 4)
        for rank in (0, 1):
            watches[0].store.delete_key(f"dsr/lost/{rank}")
        lost_peer_line(1, RANK1_CLOSED.replace("41002", "41003"), watches[1])
        same = lost_peer_line(0, RANK1_CLOSED, watches[0])
        assert same.startswith("rank 0: node localhost (ranks 0, 1, 2, 3) closed its connection ([pair.cc"), same
    finally:
        note_rank_hosts([])
        for watch in watches.values():
            watch.store = None  # (a JobWatch holds itself through its thread's target: close the clients now)
        del server


def test_a_stalled_store_does_not_hold_a_survivors_line_back():
    """Rank 0 paused (SIGSTOP): its store takes calls and never answers; a survivor that lost a peer still says so
    within STORE_PATIENCE seconds, naming the peer its own error names."""
    from common.ranks import note_rank_hosts
    from tests.multiproc import free_port
    from training.run.rank_supervisor import STORE_PATIENCE, lost_peer_line

    port = free_port()
    serve = (
        "import datetime, sys, time; from torch.distributed import TCPStore; "
        f"s = TCPStore('127.0.0.1', {port}, is_master=True, timeout=datetime.timedelta(seconds=5)); "
        "print('serving', flush=True); time.sleep(120)"
    )
    server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    watches = {}
    try:
        assert server.stdout.readline().strip() == "serving"
        watches = _store_clients(port, (1,))
        os.kill(server.pid, signal.SIGSTOP)
        note_rank_hosts(["localhost", "localhost", "127.0.0.2", "127.0.0.2"])
        limit = STORE_PATIENCE + scaled(5)
        unstall = threading.Timer(limit + 10, server.kill)  # a line that waits on the store fails, not hangs
        unstall.start()
        start = time.monotonic()
        line = lost_peer_line(1, NODE1_CLOSED, watches[1])
        took = time.monotonic() - start
        unstall.cancel()
        assert line.startswith("rank 1: node 127.0.0.2 (ranks 2, 3) closed its connection ([pair.cc"), line
        assert STORE_PATIENCE <= took < limit, took
    finally:
        note_rank_hosts([])
        with contextlib.suppress(ProcessLookupError):  # the stalled lookup gets its answer and ends quietly
            os.kill(server.pid, signal.SIGCONT)
        for thread in threading.enumerate():
            if thread.name == "lost-peer-lookup":
                thread.join(scaled(10))
        for watch in watches.values():
            watch.store = None
        server.kill()
        server.wait()


def _bash_blocks(text: str) -> list[str]:
    import re

    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_docs_slurm_shows_the_readmes_slurm_commands():
    """docs/slurm.md opens with the README's SLURM section at more length; its commands are the README's, which
    tests/test_slurm.py runs as written."""
    title = "\n## Launch on a SLURM cluster\n"
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8").split(title, 1)[1].split("\n## ", 1)[0]
    docs = (REPO_ROOT / "docs" / "slurm.md").read_text(encoding="utf-8").split(title, 1)[1].split("\n## ", 1)[0]
    assert _bash_blocks(readme) and _bash_blocks(docs) == _bash_blocks(readme)
