"""Waiting on a job in a test the way a shared machine allows: limits that grow with the machine's load, and a
failure that says what the job was doing.

A fixed wall-clock limit tuned on an idle machine fails on a busy one (the suite ran beside four training jobs at
load 10-20 on 2 cores: everything took 5-10× longer, nothing hung). `scaled(limit)` is the limit times the load
seen so far (load average ÷ cores, at least 1); `wait_exit` waits for a process under it and, past it, kills the
process tree and fails with each process's state, CPU time and command, and the end of the job's output.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import psutil

_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_worst = [1.0]  # the highest load factor this test process has seen


def load_factor() -> float:
    """How much slower than idle this machine may run now: 1-minute load average ÷ cores, at least 1; the highest
    seen so far (a burst that just ended still slowed what ran during it)."""
    _worst[0] = max(_worst[0], os.getloadavg()[0] / _CORES)
    return _worst[0]


def load_now() -> float:
    """The machine's load factor at this moment (1-minute load average ÷ cores, at least 1), for a setting that must
    match how fast things run now rather than bound a wait: load_factor keeps the highest ever seen."""
    load_factor()
    return max(1.0, os.getloadavg()[0] / _CORES)


def scaled(limit: float) -> float:
    return limit * load_factor()


def describe(pid: int, files=()) -> str:
    """What a job is doing: its processes (state, CPU seconds, command) and the end of its output files."""
    lines = [f"load average {os.getloadavg()[0]:.1f} on {_CORES} cores"]
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            cpu = p.cpu_times()
            lines.append(f"  pid {p.pid} {p.status()} cpu {cpu.user + cpu.system:.1f}s: {' '.join(p.cmdline())[:200]}")
    for f in files:
        path = Path(f)
        if path.is_file():
            lines.append(f"--- {path.name} (end) ---\n{path.read_text(errors='replace')[-2000:]}")
    return "\n".join(lines)


def running(pid: int) -> bool:
    """The process exists and has not ended (a zombie, dead but not yet reaped by its parent, has ended)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for p in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def wait_exit(popen: subprocess.Popen, limit: float, what: str, files=()) -> int:
    """popen's exit status; past `limit` seconds scaled by the load (rechecked while waiting), kill its tree and
    fail with what it was doing."""
    start = time.monotonic()
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return popen.wait(timeout=0.5)
        if time.monotonic() - start > scaled(limit):
            report = describe(popen.pid, files)
            kill_tree(popen.pid)
            popen.wait()
            raise AssertionError(
                f"{what} did not end within {time.monotonic() - start:.0f} s ({limit:.0f} s × "
                f"load factor {load_factor():.1f}); it was doing:\n{report}"
            )


def wait_until(ready, popen: subprocess.Popen, limit: float, what: str, files=()) -> None:
    """Until ready() holds; fails if the job ends first, or past `limit` scaled by the load, saying what it did."""
    start = time.monotonic()
    while not ready():
        if popen.poll() is not None:
            raise AssertionError(f"{what}: the job ended early (rc={popen.returncode}):\n{describe(popen.pid, files)}")
        if time.monotonic() - start > scaled(limit):
            raise AssertionError(
                f"{what}: not within {time.monotonic() - start:.0f} s ({limit:.0f} s × load factor "
                f"{load_factor():.1f}); the job was doing:\n{describe(popen.pid, files)}"
            )
        time.sleep(0.2)
