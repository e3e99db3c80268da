"""Runs that fail safely: each fault as an operator meets it, and the one line they read now.

Real runs throughout: train.py and run.sh through DeepSpeed's launcher, real signals (SIGKILL, SIGSTOP, SIGTERM),
a real full disk (a small tmpfs; where this user cannot mount one, the file-size limit `ulimit -f`, which fails
the same writes with EFBIG instead of ENOSPC). Two faults are injected, as tests/test_checkpoint.py does with
DSR_CRASH_AT: DSR_NAN_AT turns one step's loss into nan on every rank (the engine then meets a real non-finite
gradient), and DSR_CRASH_AT kills a run mid-training. The divergence case is the operator's own: --lr 1e12.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.launch import (
    REPO_ROOT,
    TRAIN_MANY,
    env,
    launch_cmd,
    merged,
    one_error,
    read_metrics,
    run_python,
    run_script,
    run_train,
    script_env,
    step_dir,
    train_flags,
)
from tests.progress import scaled, wait_exit, wait_until

# how a process dies and what it leaves behind is these tests' subject: every command its own interpreter
pytestmark = pytest.mark.usefixtures("real_interpreters")


def strict_metrics(out) -> list[dict]:
    """metrics.jsonl as strict JSON (NaN or Infinity would raise)."""

    def refuse(token):
        raise ValueError(f"{token} in metrics.jsonl")

    return [json.loads(line, parse_constant=refuse) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def error_lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]


def same_weights(a, b) -> bool:
    return all(
        torch.equal(a["model"][n], b["model"][n])
        and torch.equal(a["optimizer"][n]["exp_avg"], b["optimizer"][n]["exp_avg"])
        and torch.equal(a["optimizer"][n]["exp_avg_sq"], b["optimizer"][n]["exp_avg_sq"])
        for n in a["model"]
    )


def latest(out) -> str:
    return (Path(out) / "checkpoints" / "latest").read_text()


# ------------------------------------------------------------------------------------------- non-finite steps
def test_diverging_run_stops_by_default_and_skip_drops_updates_on_every_rank(
    multi30k_tsv, bpe_tokenizer, tmp_path, monkeypatch
):
    """One launch of 2 processes. Under tp2 (fp32 ZeRO-0: our ClippingAdamW) and dp2 with ZeRO-1 (DeepSpeed's
    optimizer), --nan_policy skip with step 3's loss made nan on every rank (DSR_NAN_AT): weights and AdamW moments
    after step 3 equal those after step 2 bit for bit, the schedule holds for the skipped step, training goes on
    and skipped_steps counts it. Then the operator's case, --lr 1e12 under tp2 with the default policy: step 2's
    loss is nan and the run stops there — one line from the two ranks, metrics.jsonl strict JSON, step 2's update
    dropped, and step 1's checkpoint stays the latest, unpruned."""
    common = [
        "--save_checkpoint_steps",
        1,
        "--nan_policy",
        "skip",
        "--lr_schedule",
        "inverse_sqrt",
        "--warmup_steps",
        4,
        "--steps",
        5,
    ]
    layouts = {"tp2": ["--mp", 2], "dp2-zero1": ["--enable_parallel_optimizer", 1]}
    runs = [
        train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / name, *common, *extra) for name, extra in layouts.items()
    ]
    diverging = tmp_path / "lr1e12"
    runs.append(
        train_flags(
            multi30k_tsv,
            bpe_tokenizer,
            diverging,
            "--mp",
            2,
            "--lr",
            "1e12",
            "--steps",
            6,
            "--save_checkpoint_steps",
            1,
            "--keep_checkpoint_max",
            1,
        )
    )
    runs_file = tmp_path / "runs.json"
    runs_file.write_text(json.dumps([[str(a) for a in r] for r in runs]))
    monkeypatch.setenv("DSR_NAN_AT", "3")
    proc = subprocess.run(
        launch_cmd(2, TRAIN_MANY, launcher="deepspeed") + [str(runs_file)],
        cwd=REPO_ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    one_error(proc, "step 2: the loss is nan", "--nan_policy stop", f"latest checkpoint stays {step_dir(diverging, 1)}")
    for name in layouts:
        records = strict_metrics(tmp_path / name)
        assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1], name
        assert [r["loss"] is None for r in records] == [False, False, True, False, False], name
        assert records[3]["lr"] == records[2]["lr"] != records[1]["lr"], name  # the schedule held
        two, three, four = (merged(step_dir(tmp_path / name, s)) for s in (2, 3, 4))
        assert same_weights(two, three), name
        assert not same_weights(three, four), name
    records = strict_metrics(diverging)
    assert [(r["step"], r["loss"] is None, r["skipped_steps"]) for r in records] == [(1, False, 0), (2, True, 1)]
    assert latest(diverging) == "step_00000001"
    from training.checkpoint.recovery_script import HINT, SCRIPT

    assert sorted(p.name for p in (diverging / "checkpoints").iterdir()) == sorted(
        ["latest", "step_00000001", HINT, SCRIPT]
    )


def test_skip_limit_stops_a_run_that_does_not_recover(multi30k_tsv, bpe_tokenizer, tmp_path):
    """--lr 1e12 with --nan_policy skip: every step from 2 on is non-finite and dropped (their checkpoints hold
    step 1's weights); after --nan_skip_limit 3 in a row the run stops."""
    out = tmp_path / "run"
    proc = run_train(
        1,
        train_flags(
            multi30k_tsv,
            bpe_tokenizer,
            out,
            "--lr",
            "1e12",
            "--steps",
            10,
            "--nan_policy",
            "skip",
            "--nan_skip_limit",
            3,
            "--save_checkpoint_steps",
            1,
            "--keep_checkpoint_max",
            5,
        ),
        check=False,
    )
    one_error(proc, "step 4: 3 non-finite steps in a row (--nan_skip_limit 3)", f"{step_dir(out, 3)}")
    assert [r["skipped_steps"] for r in strict_metrics(out)] == [0, 1, 2, 3]
    one = merged(step_dir(out, 1))
    assert all(same_weights(one, merged(step_dir(out, s))) for s in (2, 3))


def test_resume_from_a_path_after_a_crash_and_no_save_of_non_finite_weights(multi30k_tsv, bpe_tokenizer, tmp_path):
    """Run A is killed (kill -9) after logging step 5 of 8 (saves every 2: latest step_4). Run B resumes it by
    naming that checkpoint (--resume PATH): metrics.jsonl and TensorBoard hold steps 1-8 once each. In run B one
    weight becomes inf after step 8 (DSR_INF_WEIGHT_AT): its save is refused, `latest` stays step_6 and keep-2
    pruning leaves steps 4 and 6."""
    out = tmp_path / "run"
    # synchronous saves: step 4's is committed before step 5 (a background one may still be in flight when rank 0
    # dies: tests/test_background_save.py)
    args = train_flags(
        multi30k_tsv,
        bpe_tokenizer,
        out,
        "--steps",
        8,
        "--save_checkpoint_steps",
        2,
        "--keep_checkpoint_max",
        2,
        "--tensorboard",
        1,
        "--save_mode",
        "sync",
    )
    crashed = subprocess.run(
        launch_cmd(1) + [str(a) for a in args],
        cwd=REPO_ROOT,
        env=dict(env(), DSR_CRASH_AT="train:5"),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    resumed = subprocess.run(
        launch_cmd(1) + [str(a) for a in args + ["--resume", step_dir(out, 4)]],
        cwd=REPO_ROOT,
        env=dict(env(), DSR_INF_WEIGHT_AT="8"),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert f"resumed from {step_dir(out, 4)} at step 4" in resumed.stdout  # --resume PATH is used
    assert "removed 1 records after step 4" in resumed.stdout
    assert [r["step"] for r in strict_metrics(out)] == list(range(1, 9))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    one_error(
        resumed,
        "step 8: the weights are not finite (",
        "so the checkpoint was not written",
        f"{step_dir(out, 6)} stays the latest",
    )
    assert latest(out) == "step_00000006"
    from training.checkpoint.recovery_script import HINT, SCRIPT

    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(
        ["latest", "step_00000004", "step_00000006", HINT, SCRIPT]
    )


def test_a_save_refuses_tied_copies_that_differ(multi30k_tsv, bpe_tokenizer, tmp_path):
    """pp2 with shared embeddings keeps the table on stage 0 and a replica on stage 1 that DeepSpeed's tied-gradient
    sum keeps identical; a checkpoint stores only the owner's copy. The step-2 save checks them (they are equal:
    parity tests check the same in fp32 and bf16); after step 3 the replica is nudged (DSR_UNTIE_AT, as an
    optimizer that skipped the sum would leave it) and the step-4 save is refused on both ranks in one line."""
    out = tmp_path / "run"
    args = train_flags(
        multi30k_tsv,
        bpe_tokenizer,
        out,
        "--steps",
        4,
        "--save_checkpoint_steps",
        2,
        "--share_embeddings",
        1,
        "--pipeline_stage",
        2,
        "--micro_batch_num",
        2,
    )
    proc = subprocess.run(
        launch_cmd(2) + [str(a) for a in args],
        cwd=REPO_ROOT,
        env=dict(env(), DSR_UNTIE_AT="3"),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    one_error(
        proc,
        "step 4: the two copies of the shared embedding table (stage 0's and the last stage's) differ",
        f"{step_dir(out, 2)} stays the latest",
    )
    assert latest(out) == "step_00000002"


# ------------------------------------------------------------------------------------------- the output folder
def test_second_run_into_the_same_folder_is_refused(multi30k_tsv, bpe_tokenizer, tmp_path):
    """While run 1 trains, the same command again is refused at once, naming run 1's pid; run 1 goes on
    untouched. Afterwards the folder's start-point rules (the real functions, on run 1's real checkpoints)."""
    out = tmp_path / "run"
    args = [
        str(a)
        for a in train_flags(
            multi30k_tsv, bpe_tokenizer, out, "--steps", 2000, "--save_checkpoint_steps", 1, "--keep_checkpoint_max", 3
        )
    ]
    first = subprocess.Popen(
        launch_cmd(1) + args, cwd=REPO_ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + scaled(120)
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert first.poll() is None and time.time() < deadline, "run 1 did not start training"
            time.sleep(0.5)
        second = run_train(1, args, check=False)
        one_error(second, f"--output_dir {out} is in use by another training run (pid {first.pid} on")
        assert first.poll() is None  # run 1 still training
        assert (out / ".train.lock").read_text().startswith(f"pid {first.pid} ")
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=scaled(60))
    steps = [r["step"] for r in strict_metrics(out)]
    assert steps == list(range(1, len(steps) + 1))  # nothing written twice

    from common.errors import UserError
    from training.config.flags import parse_args
    from training.config.sections import TrainConfig
    from training.run.output_lock import claim_output_dir
    from training.run.start_point import decide

    base = args[:-6]  # without --steps / --save_checkpoint_steps / --keep

    def claim(*extra, output_dir=out):
        """What rank 0 does: claim the folder, then decide the start point under its lock."""
        argv = [str(output_dir) if a == str(out) else a for a in base] + [str(a) for a in extra]
        section = TrainConfig.from_flags(parse_args(argv)).checkpoint
        lock = claim_output_dir(section)
        try:
            decide(section)
        finally:
            lock.release()

    newest = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    with pytest.raises(
        UserError, match=f"already holds checkpoints up to step_{newest:08d} and this run starts fresh.*--resume"
    ):
        claim()
    claim("--resume")  # the folder's own run continues
    claim("--resume", latest_path := out / "checkpoints" / latest(out))  # ...also named as a PATH
    with pytest.raises(UserError, match="also holds later checkpoints"):
        claim("--resume", step_dir(out, newest - 2))
    shutil.copytree(latest_path, tmp_path / "elsewhere" / latest_path.name)
    with pytest.raises(UserError, match="of its own; continuing .* would mix two runs"):
        claim("--ckpt_file", tmp_path / "elsewhere" / latest_path.name)
    claim("--resume", out, output_dir=tmp_path / "new")  # --resume PATH into a new folder
    with pytest.raises(UserError, match="both name a checkpoint"):
        claim("--resume", out, "--ckpt_file", out)


def test_output_dir_that_cannot_be_used_fails_before_any_work(multi30k_tsv, bpe_tokenizer, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    start = time.time()
    proc = run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, a_file / "run", "--steps", 1), check=False)
    one_error(proc, f"--output_dir {a_file / 'run'} cannot be created: {a_file} is a file")
    assert "layout:" not in proc.stdout and time.time() - start < scaled(60)  # no model was built

    from common.errors import UserError
    from training.run.output_lock import check_writable_folder

    with pytest.raises(UserError, match="is a file; choose a folder"):
        check_writable_folder(str(a_file))
    (tmp_path / "d1" / "checkpoints").parent.mkdir()
    (tmp_path / "d1" / "checkpoints").write_text("")
    with pytest.raises(UserError, match="checkpoints is a file, but train.py writes a folder there"):
        check_writable_folder(str(tmp_path / "d1"))
    (tmp_path / "d2" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(UserError, match="metrics.jsonl is a folder, but train.py writes a file there"):
        check_writable_folder(str(tmp_path / "d2"))
    with _read_only_folder(tmp_path / "ro") as ro:
        from training.run.output_lock import OutputDirLock

        with pytest.raises(
            UserError,
            match=r"cannot be (written|created) \((Read-only file system|Permission "
            r"denied)",
        ):
            OutputDirLock(check_writable_folder(str(ro / "run")), str(ro / "run"))


class _read_only_folder:
    """A folder this process cannot write into: chmod for a normal user; root ignores modes, so a read-only
    tmpfs (skipped where root may not mount)."""

    def __init__(self, path: Path):
        self.path, self.mounted = path, False

    def __enter__(self) -> Path:
        self.path.mkdir()
        if os.geteuid() != 0:
            self.path.chmod(0o555)
            return self.path
        if (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(self.path)], capture_output=True
            ).returncode
            != 0
        ):
            pytest.skip("running as root without permission to mount a read-only tmpfs")
        self.mounted = True
        return self.path

    def __exit__(self, *exc):
        if self.mounted:
            subprocess.run(["umount", str(self.path)], check=True)
        else:
            self.path.chmod(0o755)


# ------------------------------------------------------------------------------------------- a rank dies / hangs
class Job:
    """A command in the background, its output in files (a pipe nobody reads could fill and stall it)."""

    def __init__(self, cmd, folder: Path, env_: dict, new_session: bool = False):
        """new_session: the job gets a process group of its own, as a terminal's foreground job has."""
        self.out, self.err = folder / "job.stdout", folder / "job.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.popen = subprocess.Popen(
                [str(c) for c in cmd], cwd=REPO_ROOT, env=env_, stdout=out, stderr=err, start_new_session=new_session
            )
        self.pid = self.popen.pid

    def processes(self) -> list:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def wait_for(self, ready, what: str, timeout: float = 150) -> None:
        """Until ready(); `timeout` grows with the machine's load (tests/progress.py)."""
        wait_until(ready, self.popen, timeout, what, (self.out, self.err))

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the end; past `timeout` (grown with the machine's load) kill what is left and fail, saying
        what the job was doing."""
        wait_exit(self.popen, timeout, "the job", (self.out, self.err))
        return subprocess.CompletedProcess(
            self.popen.args, self.popen.returncode, self.out.read_text(), self.err.read_text()
        )


def _start_tp2(tsv, tok, out, *extra, new_session: bool = False) -> Job:
    out.mkdir(parents=True)
    job = Job(
        launch_cmd(2, launcher="deepspeed") + train_flags(tsv, tok, out, "--mp", 2, "--steps", 2000, *extra),
        out.parent,
        env(),
        new_session=new_session,
    )
    job.wait_for(
        lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2, "training"
    )
    return job


def command_line(p: psutil.Process) -> str:
    """A process's command line, "" once it has ended (a zombie or gone: processes end while a test looks)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def _processes_naming(folder) -> list:
    """Everything started for a run: its folder is in their command lines."""
    return [p for p in psutil.process_iter(["cmdline"]) if str(folder) in " ".join(p.info["cmdline"] or [])]


def _training_process(job: Job, rank: int) -> psutil.Process:
    """The process that computes for `rank`: the deepest one started with --local_rank=rank."""
    mine = [p for p in job.processes() if f"--local_rank={rank}" in command_line(p)]
    return next(p for p in mine if not any(c in mine for c in p.children()))


def test_killed_rank_is_named_with_its_signal(multi30k_tsv, bpe_tokenizer, tmp_path):
    job = _start_tp2(multi30k_tsv, bpe_tokenizer, tmp_path / "run")
    victim = _training_process(job, 0)
    victim.kill()
    killed_at = time.time()
    proc = job.finish(60)
    one_error(proc, f"error: rank 0 (pid {victim.pid} on ", "was killed by SIGKILL")
    assert time.time() - killed_at < scaled(30)


def test_stopped_rank_ends_the_job_after_comm_timeout(multi30k_tsv, bpe_tokenizer, tmp_path):
    # 20 s: with 5, one collective of the job's own start outlasted it once with two training jobs beside the suite
    timeout = 20
    job = _start_tp2(multi30k_tsv, bpe_tokenizer, tmp_path / "run", "--comm_timeout", timeout)
    victim = _training_process(job, 1)
    try:
        victim.suspend()  # SIGSTOP
        stopped_at = time.time()
        proc = job.finish(90)
    finally:
        if victim.is_running():
            victim.kill()
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert lines[0].startswith(f"error: rank 0: no answer from the other ranks within --comm_timeout {timeout} s"), (
        lines
    )
    assert lines[1].startswith(f"error: rank 1 (pid {victim.pid} on ") and "stopped by SIGSTOP" in lines[1], lines
    assert len(lines) == 2 and time.time() - stopped_at < timeout + scaled(30)


def test_sigterm_to_deepspeeds_node_launcher_saves_without_native_frames(multi30k_tsv, bpe_tokenizer, tmp_path):
    """SIGTERM to launch.py (what a scheduler sends the per-node launcher): it SIGTERMs the ranks one by one, so a
    rank can hear the stop through the step's collective, save and exit 128 + SIGTERM before its own SIGTERM — its
    supervisor took that exit for a failure and tried to tell the job's store, already gone with rank 0, while torch
    logged 30 lines of C++ frames per retry. Now: the save, its one line, and nothing native."""
    out = tmp_path / "run"
    job = _start_tp2(multi30k_tsv, bpe_tokenizer, out)
    job.popen.send_signal(signal.SIGTERM)
    proc = job.finish(60)
    text = proc.stdout + proc.stderr
    step = _logged_step(out)
    assert (
        _stopped_line(text) == f"stopped by SIGTERM at step {step}; checkpoint step_{step:08d} saved; resume "
        f"with --resume"
    )
    assert not [
        line
        for line in text.splitlines()
        if "frame #" in line or "[c10d]" in line or line.startswith(("error:", "Traceback"))
    ], text[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_signal_to_run_sh_stops_every_rank_with_a_save(sig, multi30k_tsv, bpe_tokenizer, tmp_path):
    """`kill -TERM` (or -HUP: its terminal closed; or -USR1: a batch script's `--signal=B:USR1`) of run.sh reaches
    the launcher and every rank: the step is saved, the ranks' one line names the signal, nothing is left running."""
    runs = tmp_path / "runs"
    job = Job(
        [
            "bash",
            REPO_ROOT / "run_scripts/run.sh",
            multi30k_tsv,
            2,
            "--steps",
            2000,
            "--d_model",
            32,
            "--vocab_size",
            8000,
            "--tokenizer",
            bpe_tokenizer,
            "--tensorboard",
            0,
        ],
        tmp_path,
        script_env(runs),
    )

    def job_processes():
        return _processes_naming(runs)

    try:
        job.wait_for(lambda: list(runs.glob("*/output/metrics.jsonl")), "training")
        job.popen.send_signal(sig)
        proc = job.finish(90)
        deadline = time.time() + scaled(10)
        while job_processes() and time.time() < deadline:
            time.sleep(0.5)
        left = job_processes()
        assert not left, [command_line(p)[:200] for p in left]
        assert proc.returncode == 128 + sig
        assert f"training stopped by {sig.name}; no rank is left running" in proc.stderr
        output = next(runs.glob("*/output"))
        step = _logged_step(output)
        assert _stopped_line(proc.stderr) == (
            f"stopped by {sig.name} at step {step}; checkpoint step_{step:08d} saved; resume with --resume"
        )
        assert latest(output) == f"step_{step:08d}" and _lock_is_free(output)
    finally:
        for p in job_processes():
            p.kill()


# ------------------------------------------------------------------------------------------- a stop request
def _stopped_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("stopped by ")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def _logged_step(out) -> int:
    """The last step metrics.jsonl holds (0 before the first)."""
    records = read_metrics(out) if (Path(out) / "metrics.jsonl").is_file() else []
    return records[-1]["step"] if records else 0


def _lock_is_free(out) -> bool:
    import fcntl

    with open(Path(out) / ".train.lock") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


def _lines_naming(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if word in line]


STOP_SIGNALS = [(signal.SIGUSR1, "rank 1"), (signal.SIGHUP, "rank 1"), (signal.SIGHUP, "process group")]


@pytest.mark.parametrize("sig,target", STOP_SIGNALS, ids=[f"{s.name} to {t}" for s, t in STOP_SIGNALS])
def test_a_stop_signal_saves_the_step_on_every_rank_and_the_run_resumes(
    sig, target, multi30k_tsv, bpe_tokenizer, tmp_path
):
    """SLURM's `--signal=USR1@T` (or a SIGTERM, or a SIGHUP) to one rank: every rank finishes the step it is in, they
    agree on it, the job saves it, says so in one line and exits non-zero; `--resume` continues with the next step.
    A closed terminal sends SIGHUP to its whole foreground process group — DeepSpeed's launch.py, which has no handler
    for it, dies at once, and every rank's supervisor and every rank get it directly: the ranks still agree, save and
    end, naming SIGHUP (not the launcher's end their watchers also see)."""
    out = tmp_path / "run"
    job = _start_tp2(multi30k_tsv, bpe_tokenizer, out, new_session=target == "process group")
    at = _logged_step(out)
    if target == "process group":
        os.killpg(job.pid, sig)
        job.popen.wait(timeout=scaled(30))  # launch.py dies of it at once...
        deadline = time.time() + scaled(60)  # ...and the ranks follow, having saved
        while _processes_naming(out) and time.time() < deadline:
            time.sleep(0.5)
        proc = job.finish(5)
        assert proc.returncode == -sig
    else:
        _training_process(job, 1).send_signal(sig)
        proc = job.finish(60)
        assert proc.returncode == 128 + sig
    text = proc.stdout + proc.stderr
    assert not _processes_naming(out) and "Traceback" not in text, text[-3000:]
    line = _stopped_line(text)
    step = _logged_step(out)
    assert line == f"stopped by {sig.name} at step {step}; checkpoint step_{step:08d} saved; resume with --resume"
    assert _lines_naming(proc.stderr, sig.name) == [line], proc.stderr[-3000:]
    assert at <= step <= at + 3 and latest(out) == f"step_{step:08d}" and _lock_is_free(out)
    print(f"{sig.name} to {target} after step {at}: step {step} saved")
    run_train(2, train_flags(multi30k_tsv, bpe_tokenizer, out, "--mp", 2, "--resume", "--steps", step + 2))
    assert [r["step"] for r in strict_metrics(out)][-3:] == [step, step + 1, step + 2]


def test_sighup_to_a_single_process_run_saves_the_step_and_the_run_resumes(multi30k_tsv, bpe_tokenizer, tmp_path):
    """A run without a launcher (no supervisor, no launcher to watch) whose terminal closes or whose scheduler sends
    SIGHUP: the step is saved, one line names SIGHUP, the exit status is 128 + 1, the folder's lock is free, and
    `--resume` continues at the next step."""
    out = tmp_path / "run"
    out.mkdir()
    job = Job(launch_cmd(1) + train_flags(multi30k_tsv, bpe_tokenizer, out, "--steps", 2000), out, env())
    job.wait_for(lambda: _logged_step(out) >= 2, "training")
    job.popen.send_signal(signal.SIGHUP)
    proc = job.finish(60)
    step = _logged_step(out)
    assert proc.returncode == 128 + signal.SIGHUP, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    line = f"stopped by SIGHUP at step {step}; checkpoint step_{step:08d} saved; resume with --resume"
    assert _lines_naming(proc.stderr, "SIGHUP") == [line], proc.stderr[-3000:]
    assert latest(out) == f"step_{step:08d}" and _lock_is_free(out)
    print(f"SIGHUP to one process: {line}")
    resumed = run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, out, "--resume", "--steps", step + 2))
    assert f"at step {step}" in resumed.stdout
    assert [r["step"] for r in strict_metrics(out)][-3:] == [step, step + 1, step + 2]


def test_a_closed_terminal_saves_the_step(multi30k_tsv, bpe_tokenizer, tmp_path):
    """train.py in a terminal (a pty that is its controlling terminal, as in an ssh session) whose terminal closes:
    the kernel sends SIGHUP and every later write to the terminal fails (EIO) — the next log line used to end the run
    with exit 1 before its save. Now the step is saved, the exit status is 128 + SIGHUP and the lock is free."""
    import pty
    import threading

    out = tmp_path / "run"
    master, terminal = pty.openpty()
    # the child becomes a session leader (start_new_session) and takes the pty as its controlling terminal
    take_terminal = (
        "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])"
    )
    cmd = [sys.executable, "-c", take_terminal, *launch_cmd(1)] + [
        str(a) for a in train_flags(multi30k_tsv, bpe_tokenizer, out, "--steps", 2000, "--log_interval", 1)
    ]
    popen = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env(), stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True
    )
    os.close(terminal)
    shown = []  # what the terminal showed (read, or the run would block writing)

    def read_terminal():
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 65536):
                shown.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        deadline = time.time() + scaled(150)
        while _logged_step(out) < 2:
            assert popen.poll() is None and time.time() < deadline, b"".join(shown)[-3000:]
            time.sleep(0.5)
        os.close(master)  # the terminal closes: hangup
        rc = popen.wait(timeout=scaled(60))
    finally:
        if popen.poll() is None:
            popen.kill()
    step = _logged_step(out)
    assert rc == 128 + signal.SIGHUP, b"".join(shown)[-3000:]
    assert latest(out) == f"step_{step:08d}" and _lock_is_free(out)
    print(f"closed terminal after step 2 or later: step {step} saved, exit {rc}")


def test_a_stop_signal_ignored_at_start_stays_ignored():
    """`nohup` starts a run with SIGHUP ignored so that it outlives its terminal: the stop handler leaves an ignored
    signal ignored (the rank supervisor forwards only what it handles, and its child inherits the original
    dispositions)."""
    from training.run.stop_request import StopRequest

    before = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        request = StopRequest().install()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == request._note_signal
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_sigterm_to_the_bare_deepspeed_launcher_stops_its_orphaned_ranks_with_a_save(
    multi30k_tsv, bpe_tokenizer, tmp_path
):
    """`kill -TERM` of the `deepspeed` command (what `timeout` and schedulers do) ends only DeepSpeed's runner: its
    launch.py and ranks would train on with no parent, holding the output folder. The ranks notice their launcher's
    end, save the step and stop; the folder is free again."""
    from tests.multiproc import free_port

    out = tmp_path / "run"
    out.mkdir()
    runner = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(REPO_ROOT / "run_scripts/train.py"),
    ]
    job = Job(
        runner + [str(a) for a in train_flags(multi30k_tsv, bpe_tokenizer, out, "--mp", 2, "--steps", 2000)],
        tmp_path,
        env(),
    )

    def ours():
        return _processes_naming(out)

    try:
        job.wait_for(lambda: _logged_step(out) >= 2, "training")
        at = _logged_step(out)
        job.popen.send_signal(signal.SIGTERM)
        job.popen.wait(timeout=scaled(30))  # the runner is gone at once...
        deadline = time.time() + scaled(45)  # ...and its orphans follow, having saved
        while ours() and time.time() < deadline:
            time.sleep(0.5)
        assert not ours(), [command_line(p)[:160] for p in ours()]
    finally:
        for p in ours():
            p.kill()
    text = job.out.read_text() + job.err.read_text()
    step = _logged_step(out)
    line = _stopped_line(text)
    assert line.startswith(f"stopped by the end of its launcher (deepspeed.launcher.runner, pid {job.pid}) ")
    assert line.endswith(f") at step {step}; checkpoint step_{step:08d} saved; resume with --resume"), line
    assert at <= step and latest(out) == f"step_{step:08d}"  # (the launcher is checked on once a second)
    import fcntl

    with open(out / ".train.lock") as f:  # released: the next run may have the folder
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_save_on_signal_0_stops_without_a_save_and_ctrl_c_stays_quick(multi30k_tsv, bpe_tokenizer, tmp_path):
    for sig, extra in ((signal.SIGTERM, ["--save_on_signal", 0]), (signal.SIGINT, [])):
        out = tmp_path / sig.name
        out.mkdir()
        args = train_flags(multi30k_tsv, bpe_tokenizer, out, "--steps", 2000, *extra)
        job = Job(launch_cmd(1) + [str(a) for a in args], out, env())
        job.wait_for(lambda out=out: _logged_step(out) >= 1, "training")
        job.popen.send_signal(sig)
        proc = job.finish(60)
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
        assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("step_*"))
        if sig == signal.SIGTERM:
            step = _logged_step(out)
            assert proc.returncode == 128 + signal.SIGTERM
            assert _stopped_line(proc.stderr) == (
                f"stopped by SIGTERM at step {step}; no checkpoint saved (--save_on_signal 0); nothing to resume"
            )
        else:
            assert proc.returncode == 130 and proc.stderr.strip().splitlines()[-1] == "interrupted"


def test_comm_timeout_reaches_every_process_group_nccl_ones_too(tmp_path):
    """DeepSpeed's grid creates its TP/DP/PP groups with `new_group(ranks)`, no timeout: torch then takes its
    module default for the backend — for NCCL `default_pg_nccl_timeout` (10 minutes), not the default group's. A
    CPU build of torch has no NCCL, so the test gives the module the default a CUDA build has, then reads the
    timeout torch would give a new NCCL group (and the gloo group it really creates)."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import datetime, os, sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "import torch.distributed as dist\n"
        "import torch.distributed.distributed_c10d as c10d\n"
        "c10d.default_pg_nccl_timeout = datetime.timedelta(minutes=10)   # as in a CUDA build\n"
        "from model.parallel.topology import init_deepspeed_comm\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1',\n"
        "                  MASTER_PORT=sys.argv[1])\n"
        "init_deepspeed_comm('gloo', 42.0)\n"
        "group = dist.new_group([0])\n"
        "print(c10d._get_default_timeout(dist.Backend.NCCL).total_seconds(),\n"
        "      c10d._get_default_timeout(dist.Backend.GLOO).total_seconds())\n"
    )
    from tests.multiproc import free_port

    proc = subprocess.run(
        [sys.executable, str(script), str(free_port())], capture_output=True, text=True, timeout=scaled(120), env=env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["42.0", "42.0"]


WATCHDOG_LINE = (
    "[rank1]:[E1125 06:00:00.000000 ProcessGroupNCCL.cpp:685] [PG ID 2 PG GUID 5(TP) Rank 1] Watchdog "
    "caught collective operation timeout: WorkNCCL(SeqNum=17, OpType=ALLREDUCE, NumelIn=4096, "
    "NumelOut=4096, Timeout(ms)=60000) ran for 60012 milliseconds before timing out."
)


def _run_stand_in_rank_1(script) -> subprocess.CompletedProcess:
    """`script` as rank 1 of a 2-rank job that never joins a store (no master address): its supervisor's line only."""
    e = {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "MASTER_PORT", "DSR_SUPERVISED")}
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env=dict(e, WORLD_SIZE="2", RANK="1"),
    )


def test_an_nccl_watchdog_abort_is_reported_as_a_communication_timeout(tmp_path):
    """NCCL's watchdog ends a rank whose collective outlived its timeout with SIGABRT; the rank's supervisor reads
    the watchdog's message on the rank's stderr and names the collective, its group and the wait, instead of "an
    abort in native code". The rank here is a stand-in (no GPU): it writes torch's message and aborts."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from training.run.rank_supervisor import supervise_rank\n"
        "supervise_rank()\n"
        f"print({WATCHDOG_LINE!r}, file=sys.stderr, flush=True)\n"
        "os.abort()\n"
    )
    proc = _run_stand_in_rank_1(script)
    assert proc.returncode == -signal.SIGABRT
    assert WATCHDOG_LINE in proc.stderr  # relayed as it was written
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 (pid "), proc.stderr
    assert errors[0].endswith(
        "was ended by NCCL's watchdog: ALLREDUCE #17 on process group 2 (TP) timed out after "
        "60 s (--comm_timeout); a rank did not join it (paused, hung, or its node is down)"
    )


def test_a_rank_that_crashes_in_native_code_shows_where(tmp_path):
    """A segfault has no Python traceback: our commands (common.errors.run_cli) turn on faulthandler, so the rank's
    Python stack at the crash reaches the user through its supervisor, above the line naming the rank."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import ctypes, sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from common.errors import run_cli\n"
        "from training.run.rank_supervisor import supervise_rank\n"
        "def read_through_a_null_pointer():\n"
        "    ctypes.string_at(0)\n"
        "def main():\n"
        "    supervise_rank()\n"
        "    read_through_a_null_pointer()\n"
        "run_cli(main)\n"
    )
    proc = _run_stand_in_rank_1(script)
    assert proc.returncode == -signal.SIGSEGV
    stack, _, last = proc.stderr.rstrip("\n").rpartition("\n")
    assert "Fatal Python error: Segmentation fault" in stack and "in read_through_a_null_pointer" in stack
    assert last.startswith("error: rank 1 (pid ")
    assert last.endswith("was killed by SIGSEGV (a crash in native code); the job stops")


def test_a_command_whose_stderr_has_no_file_still_runs():
    """faulthandler needs a file descriptor; a stderr without one (Jupyter's, a StringIO) runs the command without
    it, not into a traceback."""
    code = "import io, sys; sys.stderr = io.StringIO(); from common.errors import run_cli; run_cli(lambda: 7)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env(), timeout=scaled(60))
    assert proc.returncode == 7


def test_a_rank_that_stopped_on_request_is_not_news(tmp_path):
    """A rank that saved on a stop request exits 128 + the signal, often before the launcher's own SIGTERM reaches
    its supervisor (the request came through the step's collective): its supervisor writes nothing into the job's
    store (it reported a failure there, and retried a store already gone with rank 0 for 10 s)."""
    import datetime

    from torch.distributed import TCPStore

    from tests.multiproc import free_port
    from training.run.job_watch import ABORT

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    script = tmp_path / "rank.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from training.run.rank_supervisor import supervise_rank\n"
        "supervise_rank()\n"
        "print('stopped by SIGTERM at step 6; checkpoint step_00000006 saved; resume with --resume', flush=True)\n"
        f"sys.exit(128 + {int(signal.SIGTERM)})\n"
    )
    e = {k: v for k, v in env().items() if k != "DSR_SUPERVISED"}
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env=dict(e, WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
    )
    assert proc.returncode == 128 + signal.SIGTERM and not store.check([ABORT]), proc.stderr
    assert "error" not in proc.stderr


# ------------------------------------------------------------------------------------------- a full disk
def test_full_disk_during_a_save(multi30k_tsv, bpe_tokenizer, tmp_path):
    """Saves of this model take ~9.8 MB. On a 14 MB tmpfs step 1's checkpoint fits and step 2's does not. Where
    this user may not mount, run 1 saves step 1 normally and run 2 resumes it under `ulimit -f` 4 MB (EFBIG)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    args = train_flags(multi30k_tsv, bpe_tokenizer, out, "--steps", 3, "--save_checkpoint_steps", 1)
    mounted = (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(disk)], capture_output=True).returncode
        == 0
    )
    try:
        if mounted:
            proc = run_train(1, args, check=False)
            line = one_error(proc, f"the disk is full: saving checkpoint step_00000002 into {out / 'checkpoints'}")
        else:
            run_train(1, args[:-4] + ["--steps", 1, "--save_checkpoint_steps", 1])
            limit = 4 << 20
            proc = subprocess.run(
                launch_cmd(1) + [str(a) for a in args + ["--resume"]],
                cwd=REPO_ROOT,
                env=env(),
                capture_output=True,
                text=True,
                timeout=scaled(300),
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
            )
            line = one_error(proc, "a file-size limit was reached: saving checkpoint step_00000002")
        assert "The partial save was removed and step_00000001 is still the latest checkpoint" in line
        assert latest(out) == "step_00000001"
        assert merged(step_dir(out, 1))["step"] == 1  # complete and loadable
        left = [p.name for p in out.rglob("*") if p.name.endswith((".tmp", ".part"))]
        assert not left and not step_dir(out, 2).exists(), left
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


# ------------------------------------------------------------------------------------------- the CLI sweep
@pytest.fixture
def bad_inputs(tmp_path):
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "folder").mkdir()
    (d / "file").write_text("x")
    (d / "binary").write_bytes(b"\xff\xfe\x00\x80garbage\n")
    (d / "dup.json").write_text('{"model": {"d_model": 32, "d_model": 64}}')
    (d / "ds_str.json").write_text('{"deepspeed": {"gradient_clipping": "1.0"}}')
    (d / "ds_int.json").write_text('{"deepspeed": {"zero_optimization": 1}}')
    (d / "ds_bool.json").write_text('{"deepspeed": {"zero_optimization": {"overlap_comm": "no"}}}')
    (d / "ds_typo.json").write_text('{"deepspeed": {"zero_optimization": {"stag": 1}}}')
    (d / "ds_bf16.json").write_text('{"deepspeed": {"bf16": {"enabled": true}}}')
    (d / "ds_comm.json").write_text('{"deepspeed": {"communication_data_type": "bf16"}}')
    (d / "ds_comm_file.json").write_text('{"communication_data_type": null}')
    (d / "hostfile").write_bytes(b"localhost slots=2\n\xff\xfe\n")
    return d


SWEEP = [  # (CLI, arguments with {d} = the inputs folder, what the one line must say)
    ("train", ["--recipe", "{d}/folder"], "recipe {d}/folder is a folder; give the JSON file"),
    ("train", ["--recipe", "{d}/dup.json"], 'the key "d_model" appears twice in one object'),
    ("train", ["--recipe", "{d}/ds_str.json"], 'deepspeed: gradient_clipping is "1.0"; DeepSpeed expects a number'),
    ("train", ["--recipe", "{d}/ds_int.json"], "deepspeed: zero_optimization is 1; DeepSpeed expects a JSON object"),
    ("train", ["--recipe", "{d}/ds_bool.json"], 'zero_optimization.overlap_comm is "no"; DeepSpeed expects true or'),
    ("train", ["--recipe", "{d}/ds_typo.json"], "zero_optimization.stag is not a DeepSpeed setting"),
    ("train", ["--recipe", "{d}/ds_bf16.json"], "bf16.enabled is true but --precision is fp32"),
    # gradients are reduced in fp32 under every precision: a half (or DeepSpeed's precision default, null) is refused
    (
        "train",
        ["--recipe", "{d}/ds_comm.json", "--precision", "bf16"],
        'deepspeed: communication_data_type is "bf16", but gradients are averaged over the data-parallel ranks in fp32',
    ),
    (
        "train",
        ["--deepspeed_config", "{d}/ds_comm_file.json"],
        "ds_comm_file.json: communication_data_type is null, but gradients are averaged over the data-parallel ranks",
    ),
    (
        "plan",
        ["--world_size", "2", "--vocab_size", "64", "--recipe", "{d}/ds_comm.json"],
        'remove the key or set it to "fp32"',
    ),
    ("train", ["--deepspeed_config", "{d}/folder"], "--deepspeed_config {d}/folder is a folder"),
    ("train", ["--deepspeed_config", "{d}/binary"], "--deepspeed_config {d}/binary is not UTF-8 text"),
    ("plan", ["--world_size", "2", "--vocab_size", "64", "--recipe", "{d}/dup.json"], "appears twice"),
    ("plan", ["--hostfile", "{d}/hostfile"], "hostfile {d}/hostfile is not UTF-8 text"),
    ("plan", ["--hostfile", "{d}/folder"], "hostfile {d}/folder is a folder"),
    ("merge", ["{d}/file", "--output", "{d}/m.pt"], "checkpoint {d}/file is a file"),
    ("merge", ["{d}/folder", "--output", "{d}/folder"], "--output {d}/folder is a folder"),
    ("merge", ["{d}/folder", "--output", "{d}/file/m.pt"], "{d}/file is a file, not a folder"),
    (
        "evaluate",
        [
            "--ckpt_file",
            "{d}/folder",
            "--tokenizer",
            "{d}/file",
            "--src",
            "{d}/file",
            "--ref",
            "{d}/file",
            "--output",
            "{d}/folder",
        ],
        "--output {d}/folder is a folder",
    ),
]


@pytest.mark.parametrize("cli,argv,needle", SWEEP, ids=[f"{c} {' '.join(a)}" for c, a, _ in SWEEP])
def test_cli_mistakes_are_one_line(cli, argv, needle, bad_inputs, tmp_path):
    """Each CLI's main on the mistake, in-process: a UserError (run_cli prints it as the one `error:` line)."""
    from common.errors import UserError

    argv = [a.format(d=bad_inputs) for a in argv]
    sys.path.insert(0, str(REPO_ROOT / "run_scripts"))
    if cli == "train":
        from training.config.flags import parse_args

        argv = argv + ["--output_dir", str(tmp_path / "out")]
        main = parse_args
    elif cli == "plan":
        from training.plan.planner import main
    elif cli == "merge":
        from merge_checkpoint import main
    else:
        from evaluate import main
    with pytest.raises(UserError) as err:
        main(argv)
    assert needle.format(d=bad_inputs) in str(err.value)


@pytest.mark.parametrize(
    "script,args,needle",
    [
        ("run_scripts/run.sh", ["{tsv}", "2", "{d}/dup.json"], 'the key "d_model" appears twice'),
        ("run_scripts/run.sh", ["{tsv}", "2", "{d}/ds_int.json"], "zero_optimization is 1"),
        ("run_scripts/run_cluster.sh", ["{tsv}", "{d}/hostfile"], "hostfile {d}/hostfile is not UTF-8 text"),
    ],
    ids=["run.sh duplicate key", "run.sh deepspeed type", "run_cluster.sh undecodable hostfile"],
)
def test_launch_script_mistakes_are_one_line(script, args, needle, bad_inputs, tmp_path, assert_user_error):
    tsv = bad_inputs / "data.tsv"
    tsv.write_text("bonjour\thello\n")
    proc = run_script(script, [a.format(tsv=tsv, d=bad_inputs) for a in args], script_env(tmp_path / "runs"))
    assert_user_error(proc, needle.format(d=bad_inputs))
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux), whose writes fail with ENOSPC")
def test_a_full_disk_anywhere_is_one_line(capsys):
    """Any write that runs out of room (here /dev/full: the kernel's ENOSPC) ends a CLI with one line, however the
    writer reports it — torch.save turns it into `RuntimeError: ... unexpected pos`."""
    from common.errors import run_cli

    def save_to_full_disk():
        with open("/dev/full", "wb") as f:
            torch.save({"w": torch.zeros(100_000)}, f)

    with pytest.raises(SystemExit) as exit_:
        run_cli(save_to_full_disk)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: no space left on the device: free space (or raise the limit), or write to another disk"
    ]


LEAVE_SCRIPT = """
import atexit, os, sys
sys.path.insert(0, {root!r})
from common.errors import run_cli
atexit.register(lambda: print("interpreter teardown ran", flush=True))
def main():
    print("rank output", end="", flush=False)      # unflushed: leave() must flush it
    return int(os.environ["CODE"])
run_cli(main)
"""


@pytest.mark.parametrize("world,code", [("2", "0"), ("2", "3"), ("1", "0")])
def test_a_launched_rank_leaves_without_interpreter_teardown(world, code, tmp_path):
    """Every entry point leaves through common.errors.run_cli → leave(): a rank of a launched job (WORLD_SIZE > 1)
    skips the interpreter's teardown — success included — because tearing it down around the process group's native
    threads can abort the rank (SIGABRT, exit 134) after its work is done; a single process exits normally."""
    script = tmp_path / "leave.py"
    script.write_text(LEAVE_SCRIPT.format(root=str(REPO_ROOT)))
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=dict(e, WORLD_SIZE=world, RANK="1", CODE=code),
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == int(code), proc.stderr
    assert proc.stdout.startswith("rank output")
    assert ("interpreter teardown ran" in proc.stdout) == (world == "1"), proc.stdout


LEAVE_JOB_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
from common.errors import run_cli
def main():
    from training.run.job import join_job, leave_job
    join_job("true", 60)
    join_job("true", 60)   # a second run in the same job (tests/drivers/train_many.py): still one job watch
    import torch.distributed as dist
    rank = dist.get_rank()
    leave_job()
    if rank != 0:
        time.sleep(4)      # rank 0 has left (and taken the job's store with it) long before this rank does
    print(f"rank {{rank}} left", flush=True)
    return 0
run_cli(main)
"""


def test_a_finished_job_leaves_together_without_reporting_rank_0s_exit(tmp_path):
    """leave_job (train.py, the test driver, the demos): every rank's job watch stops before the barrier, so rank
    0 leaving at once (os._exit, its store gone) is not reported by a slower rank as rank 0's failure (exit 3)."""
    script = tmp_path / "leave_job.py"
    script.write_text(LEAVE_JOB_SCRIPT.format(root=str(REPO_ROOT)))
    proc = run_python(launch_cmd(2, str(script)), env=env(), timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 1 left" in proc.stdout and "stopping:" not in proc.stderr, proc.stderr[-2000:]


THREADS_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
from common.errors import run_cli
def main():
    from training.run.job import join_job, leave_job
    join_job("true", 60)
    import torch
    import torch.distributed as dist
    with open(os.path.join({out!r}, f"rank{{dist.get_rank()}}.txt"), "w") as f:    # (the ranks share stdout)
        f.write(f"threads {{torch.get_num_threads()}} env {{os.environ['OMP_NUM_THREADS']}}")
    leave_job()
    return 0
run_cli(main)
"""


@pytest.mark.parametrize("given", [None, "2"])
def test_ranks_share_the_nodes_cores_when_omp_num_threads_is_unset(given, tmp_path):
    """DeepSpeed's launcher leaves OMP_NUM_THREADS unset (every rank then runs a thread per core: 3× slower per step
    with 2 ranks on 2 cores). Unset: each rank takes cores ÷ local ranks (at least 1), said once on the node; set by
    the user: kept, nothing said."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT.format(root=str(REPO_ROOT), out=str(tmp_path)))
    e = {k: v for k, v in env().items() if k != "OMP_NUM_THREADS"}
    if given:
        e["OMP_NUM_THREADS"] = given
    proc = run_python(launch_cmd(2, str(script)), env=e, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = int(given) if given else max(1, len(os.sched_getaffinity(0)) // 2)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == f"threads {want} env {want}", rank
    assert proc.stdout.count("OMP_NUM_THREADS is not set") == (0 if given else 1), proc.stdout
