"""Joining the job: the process group (training.core.distributed) with the job watch around its rendezvous, so a
rank that fails on any node — even before the rendezvous, as rank 0 refusing its output folder — is heard by every
rank (training.run.job_watch). Every entry point that trains (train.py, the seed demos, the benchmarks) joins here."""
from __future__ import annotations

from typing import Optional

from training.core.distributed import init_distributed
from training.run.job_watch import JobWatch, mark_store_served


def join_job(distribute: str, comm_timeout: Optional[float] = None) -> int:
    """The world size, once this process is in the job's process group (or a one-process one)."""
    # before the rendezvous: rank 0 may refuse before it serves the store; after it: rank 0's store exists, and
    # its end tells every rank
    return init_distributed(distribute, comm_timeout, before_rendezvous=JobWatch.start,
                            after_rendezvous=mark_store_served)


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
