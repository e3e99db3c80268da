"""What a SLURM job's environment says about its ranks, read the same way by the batch script and by every rank.

srun starts one task per rank (run_scripts/slurm.sbatch) and tells each its place in SLURM's words: SLURM_PROCID
(the global rank), SLURM_LOCALID (the rank on its node), SLURM_STEP_NUM_TASKS (the world), SLURM_NODEID and
SLURM_STEP_TASKS_PER_NODE (`2(x3),1`: how many tasks each node runs), SLURM_STEP_NODELIST (`gpu[01-04]`: the nodes,
the first of which holds task 0). `rank_env` turns them into the RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_SIZE /
MASTER_ADDR / MASTER_PORT torch and DeepSpeed read. Only a task of a job step qualifies (SLURM_STEP_ID is set): the
batch shell also carries SLURM_PROCID=0 and the job's SLURM_NTASKS, and a single `python train.py` run from it must
stay one process.

The master port (`job_port`) is derived from the job id, so that two jobs never pick it at random and collide, and
moved up past ports that are busy on the node where it is chosen (the batch script runs on the first node, where
rank 0 will serve torch's store); 29500, torch's default that any other job may hold, is never chosen.

    python -m common.slurm master        prints "ADDR PORT" for this job (the batch script's MASTER_ADDR/MASTER_PORT)
"""

from __future__ import annotations

import os
import re
import socket
import sys

from common.errors import UserError, run_cli

PORT_BASE = 20000  # derived ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN)
PORT_SPAN = 20000
AVOID = {29500}  # torch's and DeepSpeed's default: other jobs hold it


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: `gpu[07-09,12],login1` → `gpu07`, `rack[2-3]-n[1-4]` → `rack2-n1`. The
    host `scontrol show hostnames` prints first (zero padding kept)."""
    depth, end = 0, len(nodelist or "")
    for i, char in enumerate(nodelist or ""):  # the first host expression ends at a comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    token = (nodelist or "")[:end].strip()
    host = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], token)
    if not host or not re.fullmatch(r"[A-Za-z0-9._-]+", host):
        raise UserError(f"cannot read the SLURM host list {nodelist!r}: set MASTER_ADDR to the first node's address")
    return host


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed task counts per node: `2(x3),1` → [2, 2, 2, 1]."""
    counts = []
    for part in (spec or "").split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise UserError(f"cannot read SLURM's tasks per node {spec!r} (SLURM_STEP_TASKS_PER_NODE)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _free(port: int) -> bool:
    """Whether a socket could bind `port` on this machine now (as torch's store does: SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def job_port(job_id: int, free=_free) -> int:
    """The master port of SLURM job `job_id`: PORT_BASE + job_id mod PORT_SPAN, or the next one up (wrapping within
    the span) that is free here and not in AVOID."""
    for i in range(PORT_SPAN):
        port = PORT_BASE + (job_id + i) % PORT_SPAN
        if port not in AVOID and free(port):
            return port
    raise UserError(
        f"no free port in {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1} on {socket.gethostname()}: set "
        f"MASTER_PORT to a free one"
    )


def in_job_step(environ=os.environ) -> bool:
    """Whether this process is a task of an srun job step (not the batch shell, not a process outside SLURM)."""
    return environ.get("SLURM_STEP_ID", "").isdigit() and environ.get("SLURM_PROCID", "").isdigit()


def rank_env(environ=os.environ) -> dict[str, str]:
    """The variables torch and DeepSpeed read, from an srun task's SLURM variables; MASTER_ADDR / MASTER_PORT kept
    when set (the batch script sets them), else the step's first node and the job's port."""
    counts = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", ""))
    node = int(environ.get("SLURM_NODEID", "0"))
    world = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or str(sum(counts))
    env = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_SIZE": str(counts[node] if node < len(counts) else 1),
    }
    env["MASTER_ADDR"] = environ.get("MASTER_ADDR") or first_host(
        environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    )
    # no check that it is free: this rank is not where rank 0 serves the store
    env["MASTER_PORT"] = environ.get("MASTER_PORT") or str(
        job_port(int(environ.get("SLURM_JOB_ID", "0")), free=lambda _: True)
    )
    return env


def adopt(environ=os.environ) -> bool:
    """In a task of an srun step where no launcher set WORLD_SIZE (deepspeed or torchrun started inside an
    allocation set their own): set torch's variables from SLURM's (`rank_env`). True when it did. Called before
    anything reads the rank (train.py: before its rank supervisor forks) and again when joining the process group
    (training.core.distributed), where it then does nothing."""
    if "WORLD_SIZE" in environ or not in_job_step(environ):
        return False
    environ.update(rank_env(environ))
    return True


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip().splitlines()[-1].strip())
        return 0
    if args != ["master"]:
        raise UserError(f"unexpected arguments {' '.join(args)!r}: python -m common.slurm master (see --help)")
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise UserError("not inside a SLURM job (no SLURM_JOB_ID): submit with sbatch, or run inside salloc")
    print(first_host(os.environ.get("SLURM_JOB_NODELIST", "")), job_port(int(job)))
    return 0


if __name__ == "__main__":
    run_cli(main)
