"""Joining the job: the process group (training.core.distributed) with the job watch around its rendezvous, so a
rank that fails on any node — even before the rendezvous, as rank 0 refusing its output folder — is heard by every
rank (training.run.job_watch). Every entry point that trains (train.py, the seed demos, the benchmarks) joins here."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from common.ranks import local_rank_from_env, local_size_from_env
from training.core.distributed import init_distributed
from training.run.job_watch import JobWatch, mark_store_served
from training.run.stop_request import SIGNALS


def join_job(distribute: str, comm_timeout: float | None = None) -> int:
    """The world size, once this process is in the job's process group (or a one-process one)."""
    # before the rendezvous: rank 0 may refuse before it serves the store; after it: rank 0's store exists, and
    # its end tells every rank
    with stop_signals_end_the_rank():
        world = init_distributed(
            distribute, comm_timeout, before_rendezvous=JobWatch.start, after_rendezvous=mark_store_served
        )
    share_cores()
    return world


@contextlib.contextmanager
def stop_signals_end_the_rank() -> Iterator[None]:
    """Until it has joined, a rank has nothing to save, and it waits in native code (the rendezvous: for slow peers,
    or for ever in another job's store) where no Python signal handler runs: a stop request (training.run.
    stop_request) would only be noted, and the rank would wait on until the launcher's SIGKILL, 30 s later. So
    SIGTERM, SIGHUP and SIGUSR1 end it at once until it has joined — and for good if it fails to join, so the
    launcher's SIGTERM also ends it while it waits to report that (common.errors: other ranks wait 3 s, to let
    rank 0's line be the one shown). Ignored ones (nohup) stay ignored."""
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    for s, handler in saved.items():
        if handler is not None and handler != signal.SIG_IGN:
            signal.signal(s, signal.SIG_DFL)
    yield
    for s, handler in saved.items():
        if handler is not None:
            signal.signal(s, handler)


def share_cores(environ=os.environ, cores: int | None = None) -> int | None:
    """With several ranks on a node and OMP_NUM_THREADS unset, each rank takes the node's cores ÷ its ranks (at
    least 1) and local rank 0 says so once, as torchrun does; DeepSpeed's launcher leaves it unset, and every rank
    then runs a thread per core: 2 ranks on 2 cores took 3.0× longer per step. Returns the threads set, or None
    (set by the user, or one rank on the node: torch's default, every core)."""
    local = local_size_from_env()
    if "OMP_NUM_THREADS" in environ or local <= 1:
        return None
    cores = cores or len(os.sched_getaffinity(0))
    threads = max(1, cores // local)
    environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)  # torch is loaded by now: its pool takes the new size too
    if local_rank_from_env() == 0:
        print(
            f"note: OMP_NUM_THREADS is not set: each of the {local} ranks on this node uses {threads} thread"
            f"{'s' if threads > 1 else ''} ({cores} cores ÷ {local}); set OMP_NUM_THREADS to choose",
            flush=True,
        )
    return threads


def leave_job() -> None:
    """Leave the job together, after a finished (or stopped) run, before the process exits (common.errors.leave).
    Every rank first stops its job watch — rank 0's exit takes the job's store with it, which a rank still watching
    would report as rank 0's failure (exit 3) — then all meet at a barrier and tear the process group down: a rank
    that tears it down while a peer still talks to it can abort the peer ("terminate called without an active
    exception"). On an error this is skipped: the launcher stops the other ranks."""
    import torch.distributed as dist

    if JobWatch.current is not None:
        JobWatch.current.close()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
