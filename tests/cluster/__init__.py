"""The virtual cluster of tests/cluster/virtual_cluster.sh, from Python: bring it up and down, run a command on a
node (as a login there would), and see the processes each node runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from tests.progress import scaled

SCRIPT = Path(__file__).resolve().parent / "virtual_cluster.sh"
NEEDS = ("pdsh", "mpirun", "ompi_info", "orted")


def unavailable() -> str | None:
    """Why this machine cannot host the cluster (root, network namespaces, sshd, pdsh, OpenMPI), or None."""
    import shutil

    proc = subprocess.run(["bash", str(SCRIPT), "check"], capture_output=True, text=True, timeout=scaled(60))
    if proc.returncode != 0:
        return proc.stdout.strip() or proc.stderr.strip()
    missing = [tool for tool in NEEDS if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install -y pdsh openmpi-bin)"
    return None


def _proc(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


class VirtualCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.env = {}

    SCRIPT = SCRIPT  # the shell script that brings this kind of cluster up and down

    def up(self, nodes: int, slots: int = 2) -> VirtualCluster:
        return self._up(nodes, {"SLOTS": str(slots)}, "virtual cluster")

    def _up(self, nodes: int, settings: dict, name: str, limit: float = 120):
        self._guard()
        try:
            proc = subprocess.run(
                ["bash", str(self.SCRIPT), "up", str(nodes), str(self.root)],
                capture_output=True,
                text=True,
                timeout=scaled(limit),
                env=dict(os.environ, **settings),
            )
        except BaseException:  # a bring-up past its limit, Ctrl-C: what it started goes now, not at the reaper's end
            self.down()
            raise
        if proc.returncode != 0:
            self.down()
            raise RuntimeError(f"the {name} did not come up:\n{proc.stdout}\n{proc.stderr}")
        self.env = dict(line.split("=", 1) for line in (self.root / "cluster.env").read_text().split())
        self.nodes = nodes
        return self

    def _guard(self) -> None:
        """Bring this cluster down if this test process ends without doing it: a SIGTERM or SIGKILL to the suite runs
        no fixture's teardown, and the nodes' daemons, jobs and namespaces would stay on the machine. A process in a
        session of its own (no signal to the suite's group reaches it) waits for the end of a pipe only this process
        holds open, then runs the script's `down`; a normal down() ends it first."""
        self._end_guard()
        self._reaper = subprocess.Popen(
            ["bash", "-c", 'cat > /dev/null; exec bash "$0" down "$1"', str(self.SCRIPT), str(self.root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _end_guard(self) -> None:
        reaper, self._reaper = getattr(self, "_reaper", None), None
        if reaper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(reaper.pid, signal.SIGKILL)
            reaper.wait()
            reaper.stdin.close()

    def down(self) -> None:
        self._end_guard()
        subprocess.run(["bash", str(self.SCRIPT), "down", str(self.root)], capture_output=True, timeout=scaled(120))

    @property
    def hostfile(self) -> Path:
        return self.root / "hostfile"

    def addr(self, node: int) -> str:
        return self.env[f"NODE{node}_ADDR"]

    def command(self, node: int, cmd: list) -> list[str]:
        """`cmd` as it runs on `node` (its network, host name and /etc view; this process's environment)."""
        return ["bash", str(SCRIPT), "exec", str(self.root), str(node), *map(str, cmd)]

    def pids(self, node: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.env[f"NODE{node}_NS"]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def processes(self, node: int) -> list[tuple[int, str, str]]:
        """(pid, command line, process name) of everything running on `node` but its sshd."""
        sshd = int(self.env[f"NODE{node}_SSHD"])
        out = []
        for pid in self.pids(node):
            if pid != sshd and _proc(pid, "comm"):
                out.append((pid, _proc(pid, "cmdline"), _proc(pid, "comm")))
        return out

    def ranks(self, node: int) -> dict[int, int]:
        """{global rank: pid} of the training processes on `node` (not their supervisors, not the launchers)."""
        found = {}
        for pid, cmdline, comm in self.processes(node):
            if "run_scripts/train.py" in cmdline and "deepspeed.launcher" not in cmdline and comm != "rank-supervisor":
                env = _environ(pid)
                rank = env.get("RANK") or env.get("OMPI_COMM_WORLD_RANK")
                if rank is not None:
                    found[int(rank)] = pid
        return found

    def leftovers(self) -> list[tuple[int, str, str]]:
        """What still runs on any node besides its sshd (after a job: nothing should)."""
        return [p for node in range(self.nodes) for p in self.processes(node)]
