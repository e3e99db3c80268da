"""SLURM for real: run_scripts/slurm.sbatch on a virtual SLURM cluster of 3 nodes × 2 CPUs (tests/cluster/
slurm_cluster.sh: munge, slurmctld, one slurmd per network-namespace node; sbatch, srun, signals, scontrol requeue
are SLURM's own), each job submitted from a folder of its own on node 0, as a user logged in there would.

- a 4-minute limit with `--signal=B:USR1@60` (to the batch shell) on one node: every rank saves, the job requeues
  itself and resumes, until the run is done; its losses are bit-identical to an uninterrupted 2-rank run's and within
  1e-5 of one process's, each step once in metrics.jsonl, and run.json lists each launch's job id and restart count
  (submitted first, on node 2, and checked last: the other tests run meanwhile on nodes 0 and 1);
- two nodes (`-N2 --ntasks-per-node=2`, dp2×tp2) train like one process; when node 1 dies (slurmd, job step and
  ranks killed at once) rank 0 names the node and its ranks, SLURM requeues the job, and it resumes once the node is
  back;
- USR1 to every task and not to the batch shell (what `--signal=USR1@T` sends; here `scancel --signal=USR1`): the
  same requeue, decided from run.json alone;
- `scancel` ends the chain after the save; a non-finite loss and an allocation that does not fit the recipe do not
  requeue; a stop notice that reaches the batch shell after the ranks ended leaves the job COMPLETED;
- the README's "Launch on a SLURM cluster" commands, as written;
- after the module, no daemon, job or namespace is left.

Steps are slowed with DSR_STEP_DELAY (a sleep: the losses do not change, the cores stay free) so that a job is
still training when it is signalled. Needs root, network namespaces, SLURM and munge (tests/cluster/
install_packages.sh); elsewhere these tests skip with the reason.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.cluster.slurm import SlurmCluster, launches, metrics, unavailable
from tests.launch import REPO_ROOT, run_train
from tests.progress import scaled

SBATCH = REPO_ROOT / "run_scripts" / "slurm.sbatch"
README = REPO_ROOT / "README.md"
RECIPE = REPO_ROOT / "recipes" / "cpu-tiny" / "cpu-tiny.json"
# × 1 s (+ the step) = 200+ s: more than a job with --time=4 --signal=B:USR1@60 trains (USR1 60-97 s before its end,
# ~15 s to start; measured: at step 152), so at least one requeue; and the notice comes 140+ s after the job's
# start, so that beside four other jobs (a start of 40-86 s) every job still trains steps (with --time=2
# --signal=B:USR1@45 none did, 18 times in a row; with --time=3 a job once had 6 s left)
LIMIT_STEPS = 200
LIMIT_DELAY = 1.0
LIMIT_SBATCH = ["--time=4", "--signal=B:USR1@60"]

_why_not = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why_not is not None, reason=f"SLURM cluster: {_why_not}")]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    sc = SlurmCluster(tmp_path_factory.mktemp("slurm")).up(3, cpus=2)
    try:
        yield sc
    finally:
        sc.down()
        gone = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert sc.env["PREFIX"] not in gone, f"namespaces left behind: {gone}"


@pytest.fixture(scope="module")
def data(multi30k_tsv, tmp_path_factory):
    """2,000 Multi30k pairs and a 2,000-token BPE tokenizer (the size cpu-tiny builds), outside the checkout."""
    from preprocess.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("slurm-data")
    tsv = root / "train.fr_en.tsv"
    with open(multi30k_tsv, encoding="utf-8") as src, open(tsv, "w", encoding="utf-8") as dst:
        for _, line in zip(range(2000), src):
            dst.write(line)
    tokenizer = train_tokenizer([tsv], root / "bpe2k", type="bpe", vocab_size=2000)
    return {
        "tsv": tsv,
        "flags": ["--tokenizer", tokenizer, "--seed", 7, "--dropout", 0, "--log_interval", 1, "--tensorboard", 0],
    }


def job_env(**extra) -> dict:
    """The submitting shell's environment: this interpreter first on PATH, one thread per rank."""
    e = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "MASTER_", "DSR_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RUN_NAME", "RUNS_DIR", "PYTHONPATH")
    }
    e.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + e["PATH"],
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        QUIET="1",
    )
    e.update({k: str(v) for k, v in extra.items()})
    return e


def submit(slurm, folder, data, sbatch_args: list, *flags, **env) -> int:
    """sbatch SBATCH_ARGS run_scripts/slurm.sbatch DATA cpu-tiny FLAGS, from `folder` (runs go to folder/runs)."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [*sbatch_args, SBATCH, data["tsv"], RECIPE, *data["flags"], *flags]
    return slurm.sbatch(args, cwd=folder, env=job_env(RUNS_DIR=folder / "runs", **env))


def output_of(folder):
    return folder / "runs" / "cpu-tiny" / "output"


def serial_losses(data, tmp_path, steps: int) -> list[float]:
    out = tmp_path / "serial"
    run_train(
        1,
        [
            "--recipe",
            RECIPE,
            *data["flags"],
            "--mp",
            1,
            "--steps",
            steps,
            "--file_path",
            data["tsv"],
            "--output_dir",
            out,
        ],
    )
    return [r["loss"] for r in metrics(out)]


def at_step(slurm, job, folder, step: int):
    """Wait until the job's run has logged `step`; the last step logged."""

    def reached(_job):
        records = metrics(output_of(folder))
        return records[-1]["step"] if records and records[-1]["step"] >= step else None

    return slurm.wait(job, folder, reached, f"step {step}", timeout=300, poll=0.3)


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * abs(b)


@pytest.fixture(scope="module")
def limit_chain(slurm, data, tmp_path_factory):
    """The time-limited chain, submitted when the module starts, on node 2 alone; the last test checks it."""
    folder = tmp_path_factory.mktemp("limit")
    job = submit(
        slurm,
        folder,
        data,
        ["-w", "vnode2", "-N1", "--ntasks-per-node=2", *LIMIT_SBATCH],
        "--steps",
        LIMIT_STEPS,
        DSR_STEP_DELAY=LIMIT_DELAY,
    )
    return {"job": job, "folder": folder}


# ------------------------------------------------------------------------------------------------ two nodes
def test_two_nodes_train_like_one_process_and_a_lost_node_is_named_then_resumed(slurm, data, limit_chain, tmp_path):
    """dp2×tp2 on `-N2 --ntasks-per-node=2`. Node 1 dies at step 7 or later (its slurmd, job step and ranks killed at
    once: nothing on it can say so): rank 0 names the node and its ranks; SLURM marks the node down and requeues the
    job itself (--requeue); once the node is back the job resumes from the newest checkpoint and finishes. Every step's
    loss, before and after, equals one process's, each step once."""
    folder = tmp_path / "two"
    steps = 24
    job = submit(
        slurm,
        folder,
        data,
        ["-w", "vnode[0-1]", "-N2", "--ntasks-per-node=2"],
        "--world_size",
        4,
        "--steps",
        steps,
        "--save_checkpoint_steps",
        5,
        DSR_STEP_DELAY=1.0,
    )
    at_step(slurm, job, folder, 7)
    assert sorted(p.name for p in (folder / "runs/cpu-tiny/logs").glob("*/*_rank*.log")) == [
        "vnode0_rank0.log",
        "vnode0_rank1.log",
        "vnode1_rank2.log",
        "vnode1_rank3.log",
    ]
    killed = slurm.lose_node(1)
    assert "slurmd" in killed and "slurmstepd" in killed, killed
    # rank 0's line, in its log (SLURM may end the batch script before it copies the line into slurm-JOBID.out)
    named = "node vnode1 (ranks 2, 3) closed its connection"
    rank0 = next((folder / "runs/cpu-tiny/logs").glob("*/vnode0_rank0.log"))
    slurm.wait(job, folder, lambda _: named in rank0.read_text(errors="replace"), f"'{named}' in {rank0}", timeout=120)
    # SLURM finds the node gone after SlurmdTimeout (20 s here) and requeues the job, which waits for the node
    slurm.wait(job, folder, lambda fields: fields.get("Restarts") == "1", "requeue by SLURM", timeout=180)
    killed_at = metrics(output_of(folder))[-1]["step"]
    slurm.start_slurmd(1)
    fields = slurm.wait_final(job, folder)
    out = slurm.log(job, folder)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", out[-4000:]
    first, second = launches(output_of(folder))
    assert "end" not in first and second["slurm"]["restart_count"] == 1, (first, second)
    newest = second["start_step"]
    assert 5 <= newest <= killed_at and newest % 5 == 0, (newest, killed_at)
    records = metrics(output_of(folder))
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # each step once
    got, want = [r["loss"] for r in records], serial_losses(data, tmp_path, steps)
    assert all(close(g, w) for g, w in zip(got, want)), (got, want)
    print(
        f"2 nodes (dp2×tp2): max relative loss difference to one process "
        f"{max(abs(g - w) / abs(w) for g, w in zip(got, want)):.1e}; node 1 lost at step {killed_at}, the job "
        f"requeued by SLURM resumed from step {newest}"
    )


# ------------------------------------------------------------------------------------------------ stop and go on
def test_usr1_to_every_task_saves_requeues_and_resumes(slurm, data, tmp_path):
    """`--signal=USR1@T` (no B:) signals every task, not the batch shell: the script learns of the stop from
    run.json."""
    folder = tmp_path / "usr1"
    job = submit(slurm, folder, data, ["-w", "vnode0", "-N1", "--ntasks-per-node=2"], "--steps", 60, DSR_STEP_DELAY=0.2)
    at_step(slurm, job, folder, 3)
    assert slurm.run(["scancel", "--signal=USR1", job]).returncode == 0
    fields = slurm.wait_final(job, folder)
    out = slurm.log(job, folder)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", out[-4000:]
    first, second = launches(output_of(folder))
    step = first["end"]["step"]
    assert first["end"] == {**first["end"], "status": "stopped", "by": "SIGUSR1", "checkpoint": f"step_{step:08d}"}
    assert second["start_step"] == step and second["slurm"]["restart_count"] == 1, second
    assert [r["step"] for r in metrics(output_of(folder))] == list(range(1, 61))
    assert "got SIGUSR1" not in out  # the batch shell was told nothing
    assert "requeueing job (restart 1 of at most 20)" in out, out[-4000:]


def test_scancel_ends_the_chain_after_the_save(slurm, data, tmp_path):
    folder = tmp_path / "cancel"
    job = submit(
        slurm, folder, data, ["-w", "vnode0", "-N1", "--ntasks-per-node=2"], "--steps", 1000, DSR_STEP_DELAY=0.2
    )
    at_step(slurm, job, folder, 3)
    assert slurm.run(["scancel", job]).returncode == 0
    fields = slurm.wait_final(job, folder)
    out = slurm.log(job, folder)
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", out[-4000:]
    (launch,) = launches(output_of(folder))
    step = launch["end"]["step"]
    assert launch["end"]["status"] == "stopped" and launch["end"]["by"] == "SIGTERM", launch
    assert (output_of(folder) / "checkpoints" / f"step_{step:08d}" / "meta.json").exists()
    assert metrics(output_of(folder))[-1]["step"] == step
    assert "the job was cancelled" in out and "the chain ends" in out, out[-4000:]


def test_a_stop_notice_after_the_ranks_ended_leaves_the_job_completed(slurm, data, tmp_path):
    """SLURM may send `--signal=B:USR1@T` up to a minute early (its event resolution): a notice that reaches the
    batch shell after the ranks ended — while it reports and decides — must not kill it (seen once in a full run: a
    chain that had trained every step ended FAILED). USR1 goes to the batch shell every 0.1 s from the moment
    run.json says the run finished until the job has ended."""
    folder = tmp_path / "late"
    job = submit(slurm, folder, data, ["-w", "vnode0", "-N1", "--ntasks-per-node=2"], "--steps", 3)

    def finished():
        try:
            return launches(output_of(folder))[-1]["end"]["status"] == "finished"
        except (IndexError, KeyError, ValueError):  # (not yet; or read while rank 0 writes it)
            return False

    deadline = time.monotonic() + scaled(300)
    while not finished():
        assert time.monotonic() < deadline, slurm.log(job, folder)[-4000:]
        time.sleep(0.02)
    sent = 0  # until scancel finds the job no longer running
    while slurm.run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0:
        sent += 1
    fields = slurm.wait_final(job, folder)
    out = slurm.log(job, folder)
    assert sent >= 1, out[-4000:]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", (sent, out[-4000:])
    assert "training finished at step 3: the chain of jobs ends" in out, out[-4000:]
    print(f"{sent} USR1 to the batch shell after the run finished; the job COMPLETED")


def test_a_real_error_or_a_mistake_does_not_requeue(slurm, data, tmp_path):
    folder = tmp_path / "nan"
    job = submit(slurm, folder, data, ["-w", "vnode0", "-N1", "--ntasks-per-node=2"], "--steps", 20, DSR_NAN_AT=3)
    fields = slurm.wait_final(job, folder)
    out = slurm.log(job, folder)
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", out[-4000:]
    assert "training failed (srun exit status" in out and "no requeue" in out, out[-4000:]
    assert "end" not in launches(output_of(folder))[0]

    # 1 task for a 2-rank recipe: refused before any rank starts, in one line naming both
    folder = tmp_path / "mismatch"
    job = submit(slurm, folder, data, ["-w", "vnode0", "-N1", "--ntasks-per-node=1"], "--steps", 20)
    fields = slurm.wait_final(job, folder)
    out = slurm.log(job, folder)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", out
    assert len(errors) == 1 and "written for 2 processes" in errors[0] and "this job has 1 task(s)" in errors[0]
    assert "Traceback" not in out and not (folder / "runs").exists(), out


# ------------------------------------------------------------------------------------------------ the README
def _readme_commands(title: str) -> list[str]:
    readme = README.read_text(encoding="utf-8")
    assert f"\n## {title}\n" in readme, f"README.md has no section '## {title}' (its text: docs/slurm.md)"
    section = readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    text = re.sub(r"\\\n\s*", " ", "\n".join(blocks))
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.skipif(
    shutil.which("dstr-plan") is None, reason="the console commands are not installed (pip install -e .)"
)
def test_readme_slurm_commands_run_as_written(slurm, data, tmp_path):
    """In a folder holding the checkout's run_scripts/ and recipes/ and the README's out/data/train.fr_en.tsv."""
    for name in ("run_scripts", "recipes"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    (tmp_path / "out/data").mkdir(parents=True)
    shutil.copy(data["tsv"], tmp_path / "out/data/train.fr_en.tsv")
    commands = _readme_commands("Launch on a SLURM cluster")
    assert any(c.startswith("dstr-plan ") and "--slurm" in c for c in commands), commands
    assert any(c.startswith("sbatch ") for c in commands), commands
    jobs = []
    for command in commands:
        proc = slurm.run(["bash", "-c", command], cwd=tmp_path, env=job_env())
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        jobs += [int(j) for j in re.findall(r"Submitted batch job (\d+)", proc.stdout)]
        if command.startswith("dstr-plan "):
            assert re.search(
                r"sbatch .*--ntasks-per-node=\d+ .*--signal=B:USR1@\d+ .*run_scripts/slurm.sbatch", proc.stdout
            ), proc.stdout
    assert jobs, commands
    for job in jobs:
        fields = slurm.wait_final(job, tmp_path)
        assert fields["JobState"] == "COMPLETED", slurm.log(job, tmp_path)[-4000:]
    assert metrics(tmp_path / "runs/cpu-tiny/output"), list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------ the time limit
def _seconds(a: str, b: str) -> float:
    return (datetime.datetime.fromisoformat(b) - datetime.datetime.fromisoformat(a)).total_seconds()


def test_a_time_limit_saves_requeues_and_resumes_bit_identically(slurm, data, limit_chain, tmp_path):
    folder, job = limit_chain["folder"], limit_chain["job"]
    fields = slurm.wait_final(job, folder, timeout=900)
    out = slurm.log(job, folder)
    restarts = int(fields["Restarts"])
    assert fields["JobState"] == "COMPLETED" and restarts >= 1, out[-6000:]
    assert out.count("got SIGUSR1") >= 1 and "DUE TO TIME LIMIT" not in out, out[-6000:]
    records = metrics(output_of(folder))
    assert [r["step"] for r in records] == list(range(1, LIMIT_STEPS + 1))  # each step once
    # the uninterrupted run, the same layout: 2 ranks, one thread each
    reference = tmp_path / "uninterrupted"
    run_train(
        2,
        [
            "--recipe",
            RECIPE,
            *data["flags"],
            "--steps",
            LIMIT_STEPS,
            "--file_path",
            data["tsv"],
            "--output_dir",
            reference,
        ],
    )
    assert [r["loss"] for r in records] == [r["loss"] for r in metrics(reference)]  # bit for bit
    want = serial_losses(data, tmp_path, LIMIT_STEPS)  # and like one process
    assert all(close(r["loss"], w) for r, w in zip(records, want)), ([r["loss"] for r in records], want)
    runs = launches(output_of(folder))
    assert [launch["slurm"]["restart_count"] for launch in runs] == list(range(restarts + 1)), runs
    assert {launch["slurm"]["job_id"] for launch in runs} == {job}
    for before, after in zip(runs, runs[1:]):
        end = before["end"]
        assert end["status"] == "stopped" and end["by"] == "SIGUSR1", before
        assert after["start_step"] == end["step"] and end["checkpoint"] == f"step_{end['step']:08d}"  # none lost
        print(
            f"stopped at step {end['step']}, requeue to the next job's start of training: "
            f"{_seconds(end['time'], after['started']):.0f} s"
        )
    assert runs[-1]["end"]["status"] == "finished"
    saves = re.findall(r"(\d\d:\d\d:\d\d) slurm.sbatch: got SIGUSR1.*?\n(?:.*\n)*?(\d\d:\d\d:\d\d) srun ended", out)
    for got, ended in saves:
        print(
            f"USR1 to the end of the ranks (the save at the signal): "
            f"{_seconds('2000-01-01T' + got, '2000-01-01T' + ended):.0f} s"
        )
    print(f"{restarts} requeue(s) for {LIMIT_STEPS} steps")
