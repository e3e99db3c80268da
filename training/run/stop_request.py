"""A request to stop — SIGTERM, SIGUSR1 (a scheduler's preemption notice; SLURM's `--signal`) or SIGHUP (a closed
terminal, some schedulers) to any rank, or the end of the launcher that started this rank — ends the job after the
current step, on every rank at the same step, with a checkpoint of that step (`--save_on_signal`, default on).

- `StopRequest.install()` turns SIGTERM, SIGUSR1 and SIGHUP into a note (the step goes on), and starts a thread that
  watches the launcher processes above this rank (its supervisor, DeepSpeed's launch.py and runner, mpirun/orted,
  torchrun — found by their command lines when the rank starts, up to the first process that is none of these, so
  a user's shell or `nohup` is never watched). When one of them ends or is re-parented, the rank notes "the
  launcher ended": `kill -TERM` of the bare `deepspeed` command kills only the runner, whose launch.py and ranks
  would otherwise train on with no parent, holding the output folder. A signal that was ignored when the rank
  started stays ignored: `nohup` (SIGHUP ignored) keeps a run alive after its terminal closes. After a hangup the
  terminal is gone: stdout and stderr, if they were it, are pointed at /dev/null so that logging cannot end the run
  before its save.
- `agreed(device)` after every step: a one-number all-reduce (MAX) over the world, so a note on any one rank stops
  every rank after the same step (a rank that took a signal a moment later than another stops at the same step).
  The vote started after step k is read after step k+1 (after the last step at once), so the host never waits for
  it while the device has work queued: a request stops the job one step later than it was noted. A
  signal outranks the launcher's end: a closed terminal's SIGHUP also kills DeepSpeed's launch.py (it handles only
  SIGTERM and SIGINT), and the line should name the signal the job was sent, whichever a rank noticed first.
- Ctrl-C (SIGINT) keeps its quick exit: no save, "interrupted", no traceback (common.errors.run_cli).
- `preparing()` around the data's preparation (the corpus hashed, a tokenizer or token store built, another builder
  waited for): before the first step there is nothing to save, and a first build of a large corpus takes minutes,
  past any launcher's grace. A signal noted there (or before it) ends the preparation at once: it raises
  common.errors.Stopped where the build is, whose cleanup removes what it half made (the store's .tmp folder, its
  lock, the tokenizer workers); rank 0 says so in one line and every rank exits 128 + the signal.

The launcher gives the ranks time to finish: DeepSpeed's launch.py sends SIGTERM and kills what is left after 30 s,
run.sh / run_cluster.sh after 40 s; a step plus a save (and the rest of a background save in flight, which the
stop's save waits for: docs/checkpoints.md) must fit in that (on GPUs a big model's save may not: raise
the scheduler's grace period, e.g. SLURM's KillWait, or send SIGUSR1 earlier with `--signal=USR1@120`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from common.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
LAUNCHER_ENDED = 100  # the code a rank notes when its launcher ended (signals use their numbers)
SIGNAL_VOTE = 1000  # in the all-reduce a signal counts 1000 + its number, above LAUNCHER_ENDED
# command-line fragments of the processes that launch and supervise ranks
LAUNCHERS = (
    "deepspeed.launcher.launch",
    "deepspeed.launcher.runner",
    "bin/deepspeed",
    "training.run.launcher",
    "torch.distributed.run",
    "torchrun",
    "mpirun",
    "orterun",
    "orted",
    "prted",
    "prterun",
    "mpiexec",
    "rank-supervisor",
)
POLL = 1.0


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, command line) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        with open(f"/proc/{pid}/comm", "rb") as f:
            comm = f.read().decode("utf-8", "replace").strip()
    except OSError:
        return None
    ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the (comm) field
    return ppid, f"{cmdline} [{comm}]"


def launcher_chain(pid: int | None = None) -> list[tuple[int, int, str]]:
    """The launcher processes above `pid` (default: this process): (pid, its parent pid, command line), nearest
    first, up to the first ancestor that is not a launcher. The rank's supervisor is a fork of the rank, so it
    counts as a launcher by its process name."""
    chain = []
    pid = os.getpid() if pid is None else pid
    info = _proc_stat(pid)
    while info is not None:
        parent = info[0]
        if parent <= 1:
            break
        parent_info = _proc_stat(parent)
        if parent_info is None or not any(key in parent_info[1] for key in LAUNCHERS):
            break
        chain.append((parent, parent_info[0], parent_info[1]))
        info = parent_info
        pid = parent
    return chain


def program_name(cmdline: str) -> str:
    """What a command line runs, briefly: the module of `python -m MODULE`, else the script or program's name."""
    words = cmdline.split(" [")[0].split()
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    scripts = [w for w in words[1:] if w.endswith(".py")]
    return os.path.basename(scripts[0] if scripts else (words[0] if words else "?"))


def _hung_up(fd: int) -> bool:
    """Whether `fd` is a terminal that was hung up (closed): poll says POLLHUP at once (a live terminal, a file or a
    pipe does not)."""
    import select

    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLHUP for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def leave_a_closed_terminal() -> None:
    """After its terminal closed, every write to it fails (EIO), and the next log line would end the run with a
    traceback before its save: stdout and stderr, where they are that terminal, go to /dev/null instead."""
    for fd in (1, 2):
        if _hung_up(fd):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)


class StopRequest:
    def __init__(self):
        self.code = 0  # 0: none; a signal number; LAUNCHER_ENDED
        self.launcher = ""  # which launcher ended
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._chain: list[tuple[int, int, str]] = []
        self._pending: _Vote | None = None  # the vote started after the last step, read after the next
        self._preparing = False  # a signal now raises Stopped (see preparing)

    def install(self) -> StopRequest:
        for s in SIGNALS:
            if signal.getsignal(s) != signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(s, self._note_signal)
        chain = self._chain = launcher_chain()
        if chain and os.path.isdir("/proc"):
            self._thread = threading.Thread(target=self._watch, name="launcher-watch", daemon=True)
            self._thread.start()
        return self

    def _note_signal(self, signum, _frame) -> None:
        if signum == signal.SIGHUP:
            leave_a_closed_terminal()
        if not self.code or self.code == LAUNCHER_ENDED:  # the signal is the cause, the launcher's end its effect
            self.code = int(signum)
        if self._preparing:
            raise self._stopped()

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """While the data is prepared, a stop request ends the run at once (module docstring)."""
        self._preparing = True
        try:
            if self.code:  # noted before: stop before starting
                raise self._stopped()
            yield
        finally:
            self._preparing = False

    def _stopped(self) -> Stopped:
        self._preparing = False  # raised once: the cleanup on its way up is not cut short in turn
        return Stopped(
            f"stopped by {self.describe(self.code, self.launcher)} while preparing the data, before the "
            f"first step: nothing to save, and nothing half built is left; the same command starts again",
            self.exit_status(self.code),
        )

    def _watch(self) -> None:
        while not self._closing.wait(POLL):
            if self._look():
                return

    def _look(self) -> bool:
        """A launcher in the chain ended: it is gone (or its pid now names another program), or — below the top of
        the chain — it was re-parented (its parent ended). The top's own parent is not watched: a launcher started
        with nohup from a shell that then exits goes on, and so do its ranks."""
        chain = self._chain
        ended = None
        for i, (pid, ppid, cmdline) in enumerate(chain):
            now = _proc_stat(pid)
            if now is None or now[1] != cmdline:
                ended = i  # the highest one gone is where it started
            elif i < len(chain) - 1 and now[0] != ppid and ended is None:
                ended = i + 1
        if ended is None:
            return False
        pid, _, cmdline = chain[ended]
        if not self.launcher:
            self.launcher = f"{program_name(cmdline)}, pid {pid}"
        if not self.code:
            self.code = LAUNCHER_ENDED
        return True

    def close(self) -> None:
        self._closing.set()

    def agreed(self, device, world: int, final: bool = False) -> int:
        """The stop code every rank agrees on after this step (0: go on). Collective when world > 1: reads the vote
        started after the previous step and starts this step's, which the next call reads; `final` (the loop's last
        step, the same on every rank) votes and reads at once, and leaves nothing in flight."""
        if world <= 1:
            return self.code
        agreed = self._pending.read() if self._pending is not None else 0
        self._pending = None
        if not agreed:
            vote = _Vote(device, SIGNAL_VOTE + self.code if self.code and self.code != LAUNCHER_ENDED else self.code)
            if final:
                agreed = vote.read()
            else:
                self._pending = vote
        return agreed - SIGNAL_VOTE if agreed > SIGNAL_VOTE else agreed

    def describe_agreed(self, code: int) -> str:
        """`describe` for the code the ranks agreed on; when another rank noticed its launcher's end first, this
        rank looks at its own launchers once more to name the one that ended."""
        if code == LAUNCHER_ENDED and not self.launcher:
            self._look()
        return self.describe(code, self.launcher)

    @staticmethod
    def describe(code: int, launcher: str = "") -> str:
        if code == LAUNCHER_ENDED:
            return "the end of its launcher" + (f" ({launcher})" if launcher else "")
        try:
            return signal.Signals(code).name
        except ValueError:
            return f"signal {code}"

    @staticmethod
    def exit_status(code: int) -> int:
        return 128 + (int(signal.SIGTERM) if code == LAUNCHER_ENDED else code)


class _Vote:
    """A stop vote's all-reduce (MAX), started now and read later. On a GPU the result is copied to the host behind
    the reduction on the device's queue, so reading it a step later finds it there instead of draining the queue."""

    def __init__(self, device, vote: int):
        import torch
        import torch.distributed as dist

        # filled on the device (a kernel), not copied from the host: a blocking copy would wait for the queue
        self.flag = torch.full((1,), vote, dtype=torch.int32, device=device)
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        self.copied = None
        if self.flag.is_cuda:
            self.work.wait()  # the device's stream waits for the reduction, the host does not
            self.work, self.flag = None, self.flag.to("cpu", non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def read(self) -> int:
        if self.work is not None:
            self.work.wait()
        if self.copied is not None:
            self.copied.synchronize()
        return int(self.flag.item())
