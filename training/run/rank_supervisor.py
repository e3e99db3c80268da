"""When one rank of a job dies or stops answering: one line that says which and how, and no hang — on any node.

A launcher sees its children die but cannot say it well: DeepSpeed's launch.py stops the job when any rank exits
non-zero and then prints the command line of the *last rank it started*, whichever died, while each survivor
prints gloo's "Connection reset by peer" traceback; and it sees only its own node. So:

- `supervise_rank()` (first thing in train.py, in a launched job of several processes) forks. The child trains;
  the parent — a small process without torch — waits for it, relaying the child's stderr (so it knows the child's
  last `error:` line and whether NCCL's watchdog aborted it). Only a parent learns how its child ended: if the
  child is killed by a signal nobody sent to the job as a whole (`kill -9` of one rank, the out-of-memory killer,
  a segfault), the parent prints `error: rank R (pid P on HOST) was killed by SIGKILL ...` and then dies by the same
  signal, so the launcher sees exactly what it saw before. SIGTERM, SIGHUP and SIGUSR1 sent to the parent (how
  launchers, schedulers and a closed terminal stop a job) are forwarded to the child — with SIGCONT, so a stopped
  child ends too — and reported by nobody (the child saves and says so: training.run.stop_request); one ignored
  when the rank started (`nohup`: SIGHUP) is left ignored. The child dies with the parent
  (PR_SET_PDEATHSIG). Ctrl-C reaches both through the terminal's process group.
- Every other node hears of it through the job's store (training.run.job_watch): the parent of a rank that was
  killed, or that exited with an error, writes what happened there, and every rank's watcher ends its process
  within a second or two (status job_watch.ABORTED), so each node's launcher ends too. A child that ended because
  of another rank's failure (that status) or because the job was told to stop is not news. The parent writes only
  into its own job's store, whose id the child sends once it has joined (`JoinedJob`); a rank that failed before
  joining writes nowhere (job_watch.publish_abort).
- NCCL's watchdog ends a rank whose collective waited longer than its timeout with SIGABRT; the parent recognises
  the watchdog's message in the relayed stderr and reports a communication timeout naming the collective, its
  process group and the ranks known to be paused, instead of "an abort in native code".
- Survivors (`reported_collective_failures`): a collective that fails because a peer closed its connection
  becomes a UserError printed only after `PEER_LOST_DELAY` seconds (`PEER_LOST_WAIT_FOR_NEWS` with a job watch,
  whose news of the dead rank ends it first) — the launcher, which has seen the dead rank exit, normally ends the
  survivor before that, so the dead rank's line is the one the user reads. A survivor records in the job's store
  which peer it lost; a survivor whose own broken connection is to a rank that recorded a loss names that loss
  instead (the rank it was waiting on ended as a consequence, not first).
- A rank that stops answering (paused with SIGSTOP, hung, its node gone) makes every collective that waits for it
  fail after `--comm_timeout` seconds (set on every process group: model.parallel.topology.init_deepspeed_comm). Rank 0
  reports it at once, other ranks a few seconds per rank later, so the lowest surviving rank speaks and the launcher
  ends the rest; the report names the ranks whose parents recorded them as stopped (on any node). The stopped
  rank's parent adds that its child was stopped, and since when.

Only a failure inside torch.distributed's collectives is converted; any other exception keeps its traceback.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

from common.errors import UserError
from common.ranks import world_and_rank_from_env
from training.run import job_watch

PEER_LOST_DELAY = 5.0  # > DeepSpeed's launcher poll (1 s) + its SIGTERM to every rank
# with a job watch running, the dead rank's supervisor's news normally ends this rank within a second or two; on a
# loaded machine (other jobs on its cores) it was seen to take longer than PEER_LOST_DELAY, and the survivor's
# secondary line then stood beside the cause
PEER_LOST_WAIT_FOR_NEWS = 20.0
TIMEOUT_DELAY_PER_RANK = 2.0
STORE_PATIENCE = 3.0  # seconds a survivor spends on the job's store to learn what another survivor lost
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "Socket closed",
    "NCCL communicator was aborted",
)
TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
HINTS = {
    signal.SIGKILL: "kill -9, or the kernel's out-of-memory killer: see `dmesg`",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code",
    signal.SIGABRT: "an abort in native code (its log may say why)",
    signal.SIGTERM: "a stop request sent to this rank alone",
    signal.SIGINT: "an interrupt sent to this rank alone",
}
# torch's NCCL watchdog, before it aborts the process: "... Watchdog caught collective operation timeout:
# WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for 60007 milliseconds ..."
WATCHDOG = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\((?P<work>.*?)\)"
    r"(?:\s+ran for (?P<ms>\d+) milliseconds|\s*$)"
)
PG_NAME = re.compile(r"\[PG ID (?P<id>\d+) PG GUID (?P<guid>[^\s(\]]+)(?:\((?P<desc>[^)]*)\))?")


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
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()  # the child sends its job id once it has joined (job_watch)
    child = os.fork()
    if child == 0:
        os.close(read_end)
        os.close(ready_read)
        os.dup2(write_end, 2)  # the child's stderr goes through the parent (StderrRelay)
        os.close(write_end)
        os.environ[job_watch.READY_FD] = str(ready_write)
        _die_with_parent(parent)
        return
    os.close(write_end)
    os.close(ready_write)
    _watch(child, rank, world, StderrRelay(read_end), JoinedJob(ready_read))


def _prctl(option: int, arg) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _set_process_name(name: bytes) -> None:
    _prctl(15, name)  # PR_SET_NAME (ps -o comm, top)


def _die_with_parent(parent: int) -> None:
    _prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


class StderrRelay:
    """Copies the child's stderr to the parent's, byte for byte, remembering its last `error:` line and NCCL's
    watchdog message."""

    def __init__(self, fd: int):
        self.fd = fd
        self.last_error: str | None = None
        self.watchdog: str | None = None
        self._partial = b""
        self._thread = threading.Thread(target=self._run, name="stderr-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(2, view) :]
                except OSError:
                    break
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()[-4096:]
            for line in lines:
                self._note(line.decode("utf-8", "replace"))

    def _note(self, line: str) -> None:
        if line.startswith("error: "):
            self.last_error = line[len("error: ") :].strip()
        elif "Watchdog caught collective operation timeout" in line:
            self.watchdog = line.strip()

    def finish(self) -> None:
        """Wait for the child's last words (not for long: a grandchild may hold the pipe open)."""
        self._thread.join(timeout=2.0)
        if self._partial:
            self._note(self._partial.decode("utf-8", "replace"))


def watchdog_report(line: str) -> str:
    """NCCL's watchdog line → what timed out, in words (the collective, its sequence number, its group)."""
    m = WATCHDOG.search(line)
    if not m:
        return "a collective timed out"
    fields = dict(kv.split("=", 1) for kv in m.group("work").replace(" ", "").split(",") if "=" in kv)
    what = fields.get("OpType", "a collective")
    seq = f" #{fields['SeqNum']}" if "SeqNum" in fields else ""
    group = ""
    pg = PG_NAME.search(line)
    if pg:
        group = f" on process group {pg.group('id')}" + (f" ({pg.group('desc')})" if pg.group("desc") else "")
    waited = f" after {int(m.group('ms')) / 1000:.0f} s" if m.group("ms") else ""
    return f"{what}{seq}{group} timed out{waited} (--comm_timeout)"


class JoinedJob:
    """The job id the child sends on the ready pipe once it has joined its job (job_watch.mark_store_served); None
    before that, or if it never did — then this supervisor writes into no store."""

    def __init__(self, fd: int):
        self.fd, self.job = fd, None
        os.set_blocking(fd, False)

    def __call__(self) -> str | None:
        if self.job is None:
            with contextlib.suppress(OSError):
                self.job = os.read(self.fd, 256).decode() or None
        return self.job


def _watch(child: int, rank: int, world: int, relay: StderrRelay, joined: JoinedJob) -> None:
    told: list[int] = []

    def forward(signum, _frame):
        told.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)
            os.kill(child, signal.SIGCONT)  # a stopped child must run to end

    _set_process_name(b"rank-supervisor")
    for s in FORWARDED:
        if signal.getsignal(s) != signal.SIG_IGN:  # nohup: the child ignores SIGHUP too (inherited); so do we
            signal.signal(s, forward)
    signal.signal(signal.SIGINT, lambda *_: told.append(signal.SIGINT))  # the terminal sent it to the child too
    stopped_since: float | None = None
    stop_signal = signal.SIGSTOP
    where = f"rank {rank} (pid {child} on {socket.gethostname()})"
    while True:
        _, status = os.waitpid(child, os.WUNTRACED | os.WCONTINUED)
        if os.WIFSTOPPED(status):
            stopped_since, stop_signal = time.time(), os.WSTOPSIG(status)
            text = f"{where} was stopped by {_signal_name(stop_signal)} at {time.strftime('%H:%M:%S')}"
            threading.Thread(target=job_watch.publish_stopped, args=(rank, text, joined()), daemon=True).start()
        elif os.WIFCONTINUED(status):
            if not told:  # (not the SIGCONT we sent to end it)
                stopped_since = None
        else:
            break
    relay.finish()
    if stopped_since is not None:
        print(
            f"error: {where} had been stopped by {_signal_name(stop_signal)} for {time.time() - stopped_since:.0f}"
            f" s when the job was ended: it could not answer the other ranks",
            file=sys.stderr,
            flush=True,
        )
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        # a rank that stopped on a request saved and exits 128 + the signal — often before the launcher's own
        # SIGTERM reaches us (the request came through a collective): no failure, nothing to tell
        stopped = code in {128 + s for s in FORWARDED + (signal.SIGINT,)}
        if code not in (0, job_watch.ABORTED) and not told and not stopped:  # news: this rank failed
            detail = relay.last_error or f"it exited with status {code}; its log says why"
            job_watch.publish_abort(f"{where} failed: {detail}", rank, world, joined())
        os._exit(code)
    signum = os.WTERMSIG(status)
    if signum in FORWARDED + (signal.SIGINT,) and not told:
        time.sleep(0.5)  # a stop request to the whole job reaches the child a moment before us
    if not told and stopped_since is None:
        if signum == signal.SIGABRT and relay.watchdog:
            line = (
                f"error: {where} was ended by NCCL's watchdog: {watchdog_report(relay.watchdog)}; "
                f"a rank did not join it"
            )
            paused = job_watch.paused_ranks_now(world, joined())
            line += f" ({'; '.join(paused)})" if paused else " (paused, hung, or its node is down)"
        else:
            hint = HINTS.get(signum)
            line = f"error: {where} was killed by {_signal_name(signum)}{f' ({hint})' if hint else ''}; the job stops"
        print(line, file=sys.stderr, flush=True)
        job_watch.publish_abort(line[len("error: ") :], rank, world, joined())
    for s in FORWARDED + (signal.SIGINT,):
        signal.signal(s, signal.SIG_DFL)
    faulthandler.disable()  # the child's stack at a crash is the one to read, not this process's
    os.kill(os.getpid(), signum)  # end as the child did, so the launcher sees the same status
    os._exit(128 + signum)


# ------------------------------------------------------------------------------------------------ survivors
def _collective_failure(exc: BaseException) -> str | None:
    """'lost' or 'timeout' for an error raised by a torch.distributed collective, else None."""
    import torch.distributed as dist

    if not (
        isinstance(exc, RuntimeError) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    ):
        return None
    text = str(exc)
    if any(s in text for s in PEER_LOST):
        return "lost"
    if any(s in text for s in TIMED_OUT):
        return "timeout"
    return None


def _lost_peer(error: str) -> tuple[str, list[int]]:
    """Who an error's `peer [ADDRESS]:PORT` is, and its ranks: ('node vnode1 (ranks 2, 3)', [2, 3]) when the job
    gathered its hosts (a whole node lost says nothing itself: this line is the only one naming it), else
    ('another rank', [])."""
    from common.ranks import ranks_at

    # gloo names the peer as `... by peer [ADDRESS]:PORT` (closed) or `Read error [ADDRESS]:PORT: ... reset by peer`;
    # its own source position, `[/path/pair.cc:537]`, is no address
    found = re.search(r"\[([^\]/\s]+)\]:\d+", error)
    if not found:
        return "another rank", []
    host, ranks = ranks_at(found.group(1))
    if not ranks:
        return f"another rank (at {found.group(1)})", []
    return f"node {host} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})", ranks


def lost_peer_line(rank: int, error: str, watch: job_watch.JobWatch | None) -> str:
    """What rank `rank` says when a collective failed with `error` (a peer closed its connection). The peer may be a
    survivor that ended because it lost another peer first: with a job watch, what the peer's ranks recorded as lost
    is named instead, and this rank records what it names (at most STORE_PATIENCE seconds: a store that stalls —
    rank 0 paused — must not hold this line back)."""
    peer, ranks = _lost_peer(error)
    found: list[tuple[int, str]] = []  # (the rank that recorded it, what it lost)

    def look_up() -> None:
        seen = watch.losses_seen_by([r for r in ranks if r != rank])
        if seen:
            found.append(min(seen.items()))
        watch.note_loss(found[0][1] if found else peer)

    if watch is not None:
        lookup = threading.Thread(target=look_up, name="lost-peer-lookup", daemon=True)
        lookup.start()
        lookup.join(STORE_PATIENCE)
    lost, how = peer, error[:160]
    if found and found[0][1] != peer:  # (one node: every survivor names the same node, said once)
        by, lost = found[0]
        how = f"rank {by} saw it close; then {peer} closed its connection here: {how}"
    return (
        f"rank {rank}: {lost} closed its connection ({how}); it ended first, and its own line or log says why "
        f"(no line at all: its node is lost)"
    )


@contextlib.contextmanager
def reported_collective_failures(comm_timeout: float) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # re-raised unless it is a collective that lost a peer or timed out
        kind = _collective_failure(exc)
        if kind is None:
            raise
        import torch.distributed as dist

        rank = dist.get_rank()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if kind == "lost":
            watch = job_watch.JobWatch.current
            raise UserError(
                lost_peer_line(rank, first, watch),
                report_delay=PEER_LOST_WAIT_FOR_NEWS if watch is not None else PEER_LOST_DELAY,
                exit_status=job_watch.ABORTED,
            ) from None
        watch = job_watch.JobWatch.current
        paused = watch.stopped_ranks() if watch is not None else []
        who = "; ".join(paused) if paused else "a rank stopped responding (paused, hung, or its node is down)"
        raise UserError(
            f"rank {rank}: no answer from the other ranks within --comm_timeout {comm_timeout:g} s: "
            f"{who}, so the job stops. Raise "
            f"--comm_timeout if a step or a save legitimately takes longer",
            report_delay=min(TIMEOUT_DELAY_PER_RANK * rank, 60.0),
        ) from None
