"""A test session that dies with a virtual cluster up leaves nothing of it: SIGKILL (or SIGTERM, which pytest does
not handle) runs no fixture's teardown, and before, the nodes' daemons, jobs and network namespaces stayed on the
machine (seen: a suite stopped beside four training jobs left the SLURM cluster's slurmctld, three slurmd, munged
and a 2-rank SLURM job running, and four namespaces). tests/cluster's guard brings the cluster down when the process
that brought it up ends."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.cluster import unavailable
from tests.cluster.slurm import unavailable as slurm_unavailable
from tests.launch import REPO_ROOT, env
from tests.progress import running, scaled

_why_not = unavailable()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=f"virtual cluster: {_why_not}")

SESSION = """
import sys, time
from tests.cluster import VirtualCluster
from tests.cluster.slurm import SlurmCluster
cluster = {"virtual": VirtualCluster, "SLURM": SlurmCluster}[sys.argv[2]](sys.argv[1]).up(1)
print(cluster.env["PREFIX"], flush=True)
time.sleep(600)
"""


def namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=scaled(30)).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{prefix}-")]


@pytest.mark.parametrize("kind", ["virtual", "SLURM"])
def test_a_killed_session_s_cluster_is_brought_down(kind, tmp_path):
    if kind == "SLURM" and slurm_unavailable() is not None:
        pytest.skip(f"SLURM cluster: {slurm_unavailable()}")
    session = subprocess.Popen(
        [sys.executable, "-c", SESSION, tmp_path / "cluster", kind],
        cwd=REPO_ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        prefix = session.stdout.readline().strip()
        assert prefix, "the cluster did not come up"
        assert len(namespaces(prefix)) == 2  # the switch and node 0
        on_node = subprocess.run(["ip", "netns", "pids", f"{prefix}-n0"], capture_output=True, text=True).stdout.split()
        assert on_node, "no process on node 0"
    finally:
        session.kill()
        session.wait()

    def left() -> list[str]:
        return namespaces(prefix) + [f"pid {pid}" for pid in on_node if running(int(pid))]

    deadline = time.monotonic() + scaled(60)
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == []
