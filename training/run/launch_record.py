"""Each launch of a run, in run.json's "launches" (oldest first): when and where it started, from which step, under
which scheduler job — SLURM's job id and restart count, so a chain of requeued jobs reads as one run — and how it
ended. A run started afresh (no checkpoint: training.run.start_point.StartPoint.fresh) begins a new list; a resumed
one carries on the list of the run.json it resumes in.

"end" is written by rank 0 when the run ends in order: {"status": "finished", "step": N} or {"status": "stopped",
"step": N, "by": "SIGUSR1", "checkpoint": "step_0000000N" (None with --save_on_signal 0)}. A launch without "end"
did not end in order: an error, a non-finite step, a killed rank. run_scripts/slurm.sbatch reads the end of its own
launch (by DSR_LAUNCH_ID, which the launch scripts give every rank) to decide whether to requeue
(training.run.slurm_chain).
"""

from __future__ import annotations

import datetime
import json
import os
import socket

SLURM_KEYS = {
    "job_id": "SLURM_JOB_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "nodes": "SLURM_JOB_NODELIST",
    "tasks": "SLURM_STEP_NUM_TASKS",
    "partition": "SLURM_JOB_PARTITION",
}


def slurm_job(environ=os.environ) -> dict | None:
    """The SLURM job this process runs in, or None outside SLURM. restart_count: 0 for the job's first run (SLURM
    sets SLURM_RESTART_COUNT only after a requeue)."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    job = {key: environ.get(var) for key, var in SLURM_KEYS.items() if environ.get(var)}
    for key in ("job_id", "restart_count", "tasks"):
        if str(job.get(key, "")).isdigit():
            job[key] = int(job[key])
    job.setdefault("restart_count", 0)
    return job


def this_launch(start_step: int, environ=os.environ) -> dict:
    record = {
        "launch_id": environ.get("DSR_LAUNCH_ID") or None,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "start_step": start_step,
    }
    job = slurm_job(environ)
    if job is not None:
        record["slurm"] = job
    return record


def earlier_launches(output_dir: str, resumed: bool) -> list[dict]:
    """The launches recorded in OUTPUT_DIR/run.json when this launch continues that run (`resumed`), else []."""
    if not resumed:
        return []
    try:
        with open(os.path.join(output_dir, "run.json"), encoding="utf-8") as f:
            launches = json.load(f).get("launches", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [entry for entry in launches if isinstance(entry, dict)] if isinstance(launches, list) else []


def launches(output_dir: str, start_step: int, resumed: bool, environ=os.environ) -> list[dict]:
    """run.json's list for this launch: the earlier ones of the run it continues (`resumed`), then this one."""
    return earlier_launches(output_dir, resumed) + [this_launch(start_step, environ)]


def ended(launch: dict, status: str, step: int, by: str | None = None, checkpoint: str | None = None) -> None:
    """Mark how this launch ended (see the module's docstring)."""
    launch["end"] = {
        "status": status,
        "step": step,
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if status == "stopped":
        launch["end"].update(by=by, checkpoint=checkpoint)
