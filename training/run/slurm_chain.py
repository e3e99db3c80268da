"""Whether a chain of SLURM jobs goes on: after a job's ranks have ended, run_scripts/slurm.sbatch asks here, and
this job is requeued (`scontrol requeue`: the same script runs again and resumes from the run folder's newest intact
checkpoint) or the chain ends, with one line saying why.

    python -m training.run.slurm_chain --output_dir OUT --launch_id ID --status RC [--signal SIG] [--max_requeues N]
    python -m training.run.slurm_chain --max_requeues N --check       (the script's flags, before anything starts)

The job goes on only when the run stopped in order to go on: its launch in OUT/run.json ends "stopped" (a stop
signal: every rank saved the step and exited, training.run.stop_request), or it was stopped by a signal before its
first step (no record of the launch, and the batch shell or srun saw USR1/TERM/HUP: nothing new was trained, the
previous checkpoint stands) — and SLURM is not ending the job for good: the job still runs (the notice before the
time limit, `--signal=[B:]USR1@T`; `scancel --signal=...`; a preemption's grace time) or SLURM ended it at its time
limit (a TERM at the limit whose save finished within KillWait). Never after the run finished, failed for a real
error, stopped on a non-finite loss, refused a user mistake, or was cancelled by `scancel` (the job is completing
with no time limit reached) — no requeue loops — and at most --max_requeues times per job (SLURM's restart count).
Nor when this launch and the job's previous one both trained no step: the notice comes before the ranks start
training (SLURM sends it up to a minute early; a slow start), and every further job would do the same.
When SLURM ends the job because a node failed, it requeues the job itself (--requeue): the line says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from common.cli_args import Parser, integer
from common.errors import UserError, run_cli
from training.run.launch_record import earlier_launches as recorded_launches

MAX_REQUEUES = 20
STOP_SIGNALS = {"USR1": 10, "TERM": 15, "HUP": 1}
ENDING = (
    "COMPLETING",
    "CANCELLED",
    "TIMEOUT",
    "FAILED",
    "COMPLETED",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
)


@dataclass(frozen=True)
class Decision:
    requeue: bool
    line: str  # what the job's output says
    exit_status: int  # the batch script's, when the chain ends


def this_launch(output_dir: str, launch_id: str) -> dict | None:
    """This launch's record in OUTPUT_DIR/run.json (training.run.launch_record), None when it has none (the run did
    not reach its first step, or it is another launch's file)."""
    mine = [entry for entry in recorded_launches(output_dir, True) if entry.get("launch_id") == launch_id]
    return mine[-1] if mine and launch_id else None


def trained_a_step(launch: dict | None) -> bool:
    """Whether a launch trained at least one step (None: it has no record, so it was stopped before its first)."""
    if launch is None:
        return False
    end = launch.get("end") or {}
    return not (isinstance(end.get("step"), int) and end.get("step") == launch.get("start_step"))


def launch_of_restart(output_dir: str, job_id: str, restart: int) -> dict | None:
    """The record of job `job_id`'s launch with SLURM restart count `restart` in OUTPUT_DIR/run.json, if any."""
    for entry in reversed(recorded_launches(output_dir, True)):
        job = entry.get("slurm")
        if isinstance(job, dict) and str(job.get("job_id")) == job_id and job.get("restart_count") == restart:
            return entry
    return None


def job_fields(job_id: str) -> dict:
    """`scontrol -o show job ID` as {key: value} ({} when scontrol cannot say)."""
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(re.findall(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", out))


def going_on(job: dict) -> str | None:
    """Why SLURM lets this job be continued (None: SLURM is ending it for good, e.g. scancel)."""
    state, reason = job.get("JobState", ""), job.get("Reason", "")
    if state in ("RUNNING", "SUSPENDED", ""):  # (unknown: scontrol failed; the requeue will say)
        return "the job still runs"
    if reason == "TimeLimit" or state == "TIMEOUT":
        return "SLURM ended the job at its time limit"
    return None


def stopped_before_start(status: int, signal: str | None) -> bool:
    """A launch with no record that srun or the batch shell saw end by a stop signal: the ranks were stopped
    before their first step (until they join their job, a stop signal ends a rank at once)."""
    return signal in STOP_SIGNALS or status in {128 + n for n in STOP_SIGNALS.values()}


def node_lost(job: dict) -> bool:
    """Whether SLURM is ending the job because one of its nodes failed (it then requeues the job itself when it was
    submitted with --requeue, this script's default)."""
    return job.get("JobState") == "NODE_FAIL" or job.get("Reason", "").startswith(("NodeDown", "NodeFail"))


def decide(
    launch: dict | None,
    status: int,
    signal: str | None,
    job: dict,
    restarts: int,
    max_requeues: int,
    previous_trained: bool = True,
) -> Decision:
    """`previous_trained`: whether the job's previous launch (restart count - 1) trained a step (True for a first
    launch)."""
    end = (launch or {}).get("end") or {}
    if node_lost(job) and end.get("status") != "finished":
        return Decision(
            False,
            f"a node of the job was lost ({job.get('JobState')} {job.get('Reason')}): SLURM "
            f"requeues the job itself (submitted with --requeue), and it resumes from the newest "
            f"checkpoint",
            status or 1,
        )
    if end.get("status") == "finished":
        return Decision(False, f"training finished at step {end.get('step')}: the chain of jobs ends", 0)
    if end.get("status") == "stopped":
        saved = end.get("checkpoint")
        what = f"stopped by {end.get('by')} at step {end.get('step')}, " + (
            f"checkpoint {saved} saved" if saved else "no checkpoint saved (--save_on_signal 0)"
        )
    elif launch is None and stopped_before_start(status, signal):
        name = signal or next(n for n, number in STOP_SIGNALS.items() if status == 128 + number)
        what = f"stopped by SIG{name} before its first step (the last checkpoint stands)"
    else:
        return Decision(
            False,
            f"training failed (srun exit status {status}): no requeue — fix what the ranks' "
            f"error says, then submit the same command to continue from the newest checkpoint",
            status or 1,
        )
    why = going_on(job)
    status = status or 1
    if why is None:
        return Decision(
            False,
            f"{what}; the job was cancelled (scancel, or ended by SLURM: {job.get('JobState')} "
            f"{job.get('Reason')}): the chain ends — submit the same command to continue",
            status,
        )
    if job.get("BatchFlag") == "0":
        return Decision(
            False, f"{what}; not a batch job (salloc): nothing to requeue — run the script again to continue", status
        )
    if not trained_a_step(launch) and not previous_trained:
        return Decision(
            False,
            f"{what}; so was this job's previous launch: the stop notice comes before the ranks train a step "
            f"(SLURM sends --signal=[B:]USR1@T up to 60 s early), and every requeue would do the same — submit "
            f"again with a longer --time (more than the signal's lead + 60 s + the ranks' start), or a shorter "
            f"lead; the chain ends",
            status,
        )
    if restarts >= max_requeues:
        return Decision(
            False,
            f"{what}; this job was requeued {restarts} times, --max_requeues {max_requeues}: the "
            f"chain ends — submit the same command to continue",
            status,
        )
    return Decision(
        True,
        f"{what}; {why}: requeueing job (restart {restarts + 1} of at most {max_requeues}); it "
        f"resumes from the newest checkpoint",
        status,
    )


def requeue(job_id: str) -> None:
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(
            f"scontrol requeue {job_id} failed ({said[-1] if said else proc.returncode}): submit "
            f"with --requeue (the script's default; a partition or site may refuse it), or submit the "
            f"same command again to continue"
        )


def parser() -> Parser:
    p = Parser(prog="python -m training.run.slurm_chain", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--max_requeues",
        type=integer(0),
        default=MAX_REQUEUES,
        help=f"requeue one job at most this many times (SLURM's restart count; default {MAX_REQUEUES})",
    )
    p.add_argument("--check", action="store_true", help="only check the flags")
    p.add_argument("--output_dir", help="the run's train.py --output_dir")
    p.add_argument("--launch_id", default="", help="this launch's DSR_LAUNCH_ID")
    p.add_argument("--status", type=integer(0), default=0, help="srun's exit status")
    p.add_argument("--signal", default=None, help="the stop signal the batch shell got (USR1, TERM, HUP), if any")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.check:
        return 0
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id or not args.output_dir:
        raise UserError("needs SLURM_JOB_ID (inside a SLURM job) and --output_dir: run_scripts/slurm.sbatch calls it")
    job = job_fields(job_id)
    restarts = job.get("Restarts", os.environ.get("SLURM_RESTART_COUNT", "0"))
    restarts = int(restarts) if restarts.isdigit() else 0
    decision = decide(
        this_launch(args.output_dir, args.launch_id),
        args.status,
        args.signal,
        job,
        restarts,
        args.max_requeues,
        previous_trained=restarts == 0 or trained_a_step(launch_of_restart(args.output_dir, job_id, restarts - 1)),
    )
    print(f"{time.strftime('%H:%M:%S')} slurm job {job_id}: {decision.line}", flush=True)
    if decision.requeue:
        requeue(job_id)
        return 0
    return decision.exit_status


if __name__ == "__main__":
    run_cli(main)
