#!/usr/bin/env python3
"""Start N ranks of a script on this machine the way DeepSpeed's per-node launcher does, without importing it.

    python tests/drivers/spawn_ranks.py --nproc N --master_port P SCRIPT ARGS...

Each rank is `python -u SCRIPT --local_rank=R ARGS` with the environment `deepspeed.launcher.launch` gives a
single node (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT,
CUDA_VISIBLE_DEVICES...; tests/test_launch_scripts.py compares the whole environment of the two), stdout and
stderr shared with this process. As DeepSpeed's launcher does, a rank that fails ends the others and its exit
code is this process's; SIGTERM/SIGINT reach every rank.

Started from the tests' fork server (tests/launch.py run_python sets DSR_FORK_SERVER), the ranks are forks of it
too (tests/drivers/fork_server.py: each its own process, without importing torch and DeepSpeed again), in this
process's group; otherwise they are new interpreters.

Why not DeepSpeed's launcher itself: `python -m deepspeed.launcher.launch` imports DeepSpeed (and torch) before it
starts a rank, and polls its ranks once a second — about 3.5 s per launch on a 2-core CPU, spent by the tests'
many short multi-rank runs. What users run (run_scripts/run.sh, the recipes) and the failure tests
(tests/test_faults.py), whose subject is what the launcher reports, still go through DeepSpeed's launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys


def rank_env(base: dict, rank: int, nproc: int, master_port: int) -> dict:
    env = dict(base)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(nproc),
        CROSS_RANK="0",
        CROSS_SIZE="1",
        LOCAL_SIZE=str(nproc),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        # what DeepSpeed's launcher also passes on: the node's device list (set by its accelerator, the CPU
        # one included) and a flag its own import of DeepSpeed sets
        CUDA_VISIBLE_DEVICES=",".join(str(r) for r in range(nproc)),
        PYTORCH_NVML_BASED_CUDA_CHECK="1",
    )
    return env


def _forked_ranks(path: str, commands: list, envs: list) -> int:
    """The ranks as forks of the tests' fork server (tests/drivers/fork_server.py), in this process's group."""
    from fork_server import request_fork

    pgid = os.getpgid(0)
    conns = {}
    for cmd, env in zip(commands, envs):
        conn, answers, pid = request_fork(path, cmd, os.getcwd(), env, 1, 2, pgid=pgid)
        conns[conn] = (answers, pid)

    def end_all(signum=None, frame=None):
        for _, pid in conns.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if signum is not None:
            sys.exit(1)

    signal.signal(signal.SIGTERM, end_all)
    signal.signal(signal.SIGINT, end_all)
    while conns:
        ready, _, _ = select.select(list(conns), [], [])
        for conn in ready:
            answers, _ = conns.pop(conn)
            line = answers.readline()
            code = int(line) if line else 1
            conn.close()
            if code != 0:
                end_all()
                return code if code > 0 else 128 - code
    return 0


def _own_ranks(commands: list, envs: list) -> int:
    procs = [subprocess.Popen(cmd, env=env) for cmd, env in zip(commands, envs)]

    def end_all(signum=None, frame=None):
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if signum is not None:
            sys.exit(1)

    signal.signal(signal.SIGTERM, end_all)
    signal.signal(signal.SIGINT, end_all)
    by_pid = {p.pid: p for p in procs}
    while by_pid:
        pid, status = os.wait()  # blocks until a rank ends: no polling delay
        proc = by_pid.pop(pid, None)
        if proc is None:
            continue
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            end_all()
            return proc.returncode if proc.returncode > 0 else 128 - proc.returncode
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    commands = [
        [sys.executable, "-u", args.script, f"--local_rank={rank}", *args.script_args] for rank in range(args.nproc)
    ]
    envs = [rank_env(os.environ, rank, args.nproc, args.master_port) for rank in range(args.nproc)]
    server = os.environ.get("DSR_FORK_SERVER")
    if server and os.path.exists(server):
        return _forked_ranks(server, commands, envs)
    return _own_ranks(commands, envs)


if __name__ == "__main__":
    sys.exit(main())
