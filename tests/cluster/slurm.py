"""The virtual SLURM cluster of tests/cluster/slurm_cluster.sh, from Python: bring it up and down, submit a job as a
user logged in on a node, and follow a job by what it does (its state, its output file, its run folder's metrics) —
never by fixed sleeps, so a loaded machine only makes it slower."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

from tests.cluster import VirtualCluster
from tests.cluster import unavailable as cluster_unavailable
from tests.progress import scaled

SCRIPT = Path(__file__).resolve().parent / "slurm_cluster.sh"
FINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


def unavailable() -> str | None:
    """Why this machine cannot host the SLURM cluster (root, namespaces, SLURM, munge), or None."""
    why = cluster_unavailable()
    if why is not None:
        return why
    proc = subprocess.run(["bash", str(SCRIPT), "check"], capture_output=True, text=True, timeout=scaled(60))
    return None if proc.returncode == 0 else (proc.stdout.strip() or proc.stderr.strip())


class SlurmCluster(VirtualCluster):
    SCRIPT = SCRIPT

    def up(self, nodes: int, cpus: int = 2) -> SlurmCluster:
        return self._up(nodes, {"CPUS": str(cpus)}, "SLURM cluster", limit=180)

    def command(self, node: int, cmd: list) -> list[str]:
        """`cmd` as a user logged in on `node` runs it (SLURM_CONF set: sbatch, scontrol, ... reach the cluster)."""
        return ["bash", str(SCRIPT), "exec", str(self.root), str(node), *map(str, cmd)]

    def lose_node(self, node: int) -> list[str]:
        """The node dies: every process on it — slurmd, the job steps, the ranks — killed at once (all but the sshd
        that holds its namespaces, which no job uses); the names of what was killed."""
        killed = [comm for pid, _, comm in self.processes(node)]
        for pid, _, _ in self.processes(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        return killed

    def start_slurmd(self, node: int) -> None:
        """The node comes back: its slurmd starts again (SLURM returns it to service when it registers)."""
        slurmd = "/usr/sbin/slurmd" if os.path.exists("/usr/sbin/slurmd") else "slurmd"
        proc = self.run([slurmd, "-f", self.root / "slurm.conf"], node=node)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def run(self, cmd: list, node: int = 0, cwd=None, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(node, cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=scaled(timeout)
        )

    def sbatch(self, args: list, cwd, env=None) -> int:
        """Submit from folder `cwd` on node 0 (sbatch ARGS); the job id."""
        proc = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env)
        assert proc.returncode == 0, f"sbatch {args} failed:\n{proc.stdout}\n{proc.stderr}"
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job` as {key: value} ({} once SLURM has forgotten it)."""
        out = self.run(["scontrol", "-o", "show", "job", job_id]).stdout
        return dict(re.findall(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", out))

    def log(self, job_id: int, cwd) -> str:
        path = Path(cwd) / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else "(no slurm-JOBID.out yet)"

    def wait(self, job_id: int, cwd, until, what: str, timeout: float = 600, poll: float = 1.0):
        """Poll `until(job_fields)` (or `until()` reading files) until it returns something true; on timeout fail with
        the job's state and the end of its output file."""
        end = time.monotonic() + scaled(timeout)
        unknown_since = None  # SLURM has not known the job since: ended and purged (MinJobAge), it cannot progress
        while True:
            job = self.job(job_id)
            found = until(job)
            if found:
                return found
            unknown_since = None if job else (unknown_since or time.monotonic())
            if unknown_since is not None and time.monotonic() - unknown_since > scaled(15):
                raise AssertionError(
                    f"job {job_id}: no {what}, and SLURM no longer knows the job (it ended and was purged); its "
                    f"output:\n{self.log(job_id, cwd)[-4000:]}"
                )
            if time.monotonic() > end:
                raise AssertionError(
                    f"job {job_id}: no {what} within {timeout:.0f} s; state {job.get('JobState')} "
                    f"({job.get('Reason')}), restarts {job.get('Restarts')}; its output:\n"
                    f"{self.log(job_id, cwd)[-4000:]}"
                )
            time.sleep(poll)

    def wait_final(self, job_id: int, cwd, timeout: float = 600) -> dict:
        """The job's fields once it has ended for good (not requeued, not completing)."""
        return self.wait(job_id, cwd, lambda job: job if job.get("JobState") in FINAL else None, "end", timeout)


def metrics(output_dir) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launches(output_dir) -> list[dict]:
    path = Path(output_dir) / "run.json"
    return json.loads(path.read_text()).get("launches", []) if path.exists() else []
