"""When one rank of a job dies or stops answering: one line that says which and how, and no hang.

A launcher sees its children die but cannot say it well: DeepSpeed's launch.py stops the job when any rank exits
non-zero and then prints the command line of the *last rank it started*, whichever died, while each survivor
prints gloo's "Connection reset by peer" traceback. So:

- `supervise_rank()` (first thing in train.py, in a launched job of several processes) forks. The child trains;
  the parent — a small process without torch — waits for it. Only a parent learns how its child ended: if the
  child is killed by a signal nobody sent to the job as a whole (`kill -9` of one rank, the out-of-memory killer,
  a segfault), the parent prints `error: rank R (pid P on HOST) was killed by SIGKILL ...` and then dies by the same
  signal, so the launcher sees exactly what it saw before. SIGTERM and SIGHUP sent to the parent (how launchers
  stop a job) are forwarded to the child — with SIGCONT, so a stopped child ends too — and reported by nobody. The
  child dies with the parent (PR_SET_PDEATHSIG). Ctrl-C reaches both through the terminal's process group.
- Survivors (`reported_collective_failures`): a collective that fails because a peer closed its connection
  becomes a UserError printed only after `PEER_LOST_DELAY` seconds — the launcher, which has seen the dead rank
  exit, normally ends the survivor before that, so the dead rank's line is the one the user reads.
- A rank that stops answering (paused with SIGSTOP, hung, its node gone) makes every collective that waits for it
  fail after `--comm_timeout` seconds (set on every process group: model.parallel.topology.init_deepspeed_comm). Rank 0
  reports it at once, other ranks a few seconds per rank later, so the lowest surviving rank speaks and the launcher
  ends the rest. The stopped rank's parent adds that its child was stopped, and since when.

Only a failure inside torch.distributed's collectives is converted; any other exception keeps its traceback.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from typing import Iterator, Optional

from common.errors import UserError
from common.ranks import world_and_rank_from_env

PEER_LOST_DELAY = 5.0        # > DeepSpeed's launcher poll (1 s) + its SIGTERM to every rank
TIMEOUT_DELAY_PER_RANK = 2.0
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
             "Socket closed", "NCCL communicator was aborted")
TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")
FORWARDED = (signal.SIGTERM, signal.SIGHUP)
HINTS = {signal.SIGKILL: "kill -9, or the kernel's out-of-memory killer: see `dmesg`",
         signal.SIGSEGV: "a crash in native code", signal.SIGBUS: "a crash in native code",
         signal.SIGABRT: "an abort in native code (its log may say why)",
         signal.SIGTERM: "a stop request sent to this rank alone",
         signal.SIGINT: "an interrupt sent to this rank alone"}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ------------------------------------------------------------------------------------------------ the parent
def supervise_rank() -> None:
    """Return in a child process that does the work; the calling process stays behind as its supervisor and never
    returns. Nothing happens for a single process or when already supervised."""
    world, rank = world_and_rank_from_env()
    if world <= 1 or os.environ.get("DSR_SUPERVISED") or not hasattr(os, "fork"):
        return
    os.environ["DSR_SUPERVISED"] = str(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with_parent(parent)
        return
    _watch(child, rank)


def _prctl(option: int, arg) -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _set_process_name(name: bytes) -> None:
    _prctl(15, name)                                                        # PR_SET_NAME (ps -o comm, top)


def _die_with_parent(parent: int) -> None:
    _prctl(1, int(signal.SIGKILL))                                          # PR_SET_PDEATHSIG
    if os.getppid() != parent:                                              # it died before prctl took effect
        os._exit(1)


def _watch(child: int, rank: int) -> None:
    told: list[int] = []

    def forward(signum, _frame):
        told.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)
            os.kill(child, signal.SIGCONT)                                  # a stopped child must run to end

    _set_process_name(b"rank-supervisor")
    for s in FORWARDED:
        signal.signal(s, forward)
    signal.signal(signal.SIGINT, lambda *_: told.append(signal.SIGINT))    # the terminal sent it to the child too
    stopped_since: Optional[float] = None
    stop_signal = signal.SIGSTOP
    while True:
        _, status = os.waitpid(child, os.WUNTRACED | os.WCONTINUED)
        if os.WIFSTOPPED(status):
            stopped_since, stop_signal = time.time(), os.WSTOPSIG(status)
        elif os.WIFCONTINUED(status):
            if not told:                                        # (not the SIGCONT we sent to end it)
                stopped_since = None
        else:
            break
    where = f"rank {rank} (pid {child} on {socket.gethostname()})"
    if stopped_since is not None:
        print(f"error: {where} had been stopped by {_signal_name(stop_signal)} for {time.time() - stopped_since:.0f}"
              f" s when the job was ended: it could not answer the other ranks", file=sys.stderr, flush=True)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    signum = os.WTERMSIG(status)
    if signum in FORWARDED + (signal.SIGINT,) and not told:
        time.sleep(0.5)               # a stop request to the whole job reaches the child a moment before us
    if not told and stopped_since is None:
        hint = HINTS.get(signum)
        print(f"error: {where} was killed by {_signal_name(signum)}{f' ({hint})' if hint else ''}; the job stops",
              file=sys.stderr, flush=True)
    for s in FORWARDED + (signal.SIGINT,):
        signal.signal(s, signal.SIG_DFL)
    os.kill(os.getpid(), signum)      # end as the child did, so the launcher sees the same status
    os._exit(128 + signum)


# ------------------------------------------------------------------------------------------------ survivors
def _collective_failure(exc: BaseException) -> Optional[str]:
    """'lost' or 'timeout' for an error raised by a torch.distributed collective, else None."""
    import torch.distributed as dist
    if not (isinstance(exc, RuntimeError) and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1):
        return None
    text = str(exc)
    if any(s in text for s in PEER_LOST):
        return "lost"
    if any(s in text for s in TIMED_OUT):
        return "timeout"
    return None


@contextlib.contextmanager
def reported_collective_failures(comm_timeout: float) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a collective that lost a peer or timed out
        kind = _collective_failure(exc)
        if kind is None:
            raise
        import torch.distributed as dist
        rank = dist.get_rank()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if kind == "lost":
            raise UserError(f"rank {rank}: another rank closed its connection ({first[:160]}); it ended first, "
                            f"and its own line or log says why", report_delay=PEER_LOST_DELAY) from None
        raise UserError(f"rank {rank}: no answer from the other ranks within --comm_timeout {comm_timeout:g} s: "
                        f"a rank stopped responding (paused, hung, or its node is down), so the job stops. Raise "
                        f"--comm_timeout if a step, a save or data preparation legitimately takes longer",
                        report_delay=min(TIMEOUT_DELAY_PER_RANK * rank, 60.0)) from None
