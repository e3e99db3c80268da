"""Which process this is: its global and local rank, from the launcher's environment or the process group.

Known before torch.distributed exists (the launcher's RANK / LOCAL_RANK, or OpenMPI's OMPI_COMM_WORLD_* under
mpirun) and after it (torch.distributed's own numbers). One home, so every caller agrees on what rank 0 is.
"""

from __future__ import annotations

import os

ENV_KEYS = (("WORLD_SIZE", "RANK"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"))


def _env_int(key: str) -> int | None:
    value = os.environ.get(key, "").strip()
    return int(value) if value.isdigit() else None


def global_rank_from_env() -> int:
    """The global rank a launcher gave this process (0 for a plain `python train.py`); known before the process
    group exists."""
    for key in ("RANK", "OMPI_COMM_WORLD_RANK"):
        rank = _env_int(key)
        if rank is not None:
            return rank
    return 0


def world_and_rank_from_env() -> tuple[int, int]:
    """(world size, global rank) as the launcher set them; (1, 0) when no launcher did."""
    for size_key, rank_key in ENV_KEYS:
        size, rank = _env_int(size_key), _env_int(rank_key)
        if size is not None and rank is not None:
            return size, rank
    return 1, 0


def local_size_from_env() -> int:
    """How many ranks the launcher started on this node (1 for one process): deepspeed, torchrun, mpirun."""
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        size = _env_int(key)
        if size is not None and size > 0:
            return size
    return 1


def local_rank_from_env() -> int:
    """This process's rank on its node (0 for one process)."""
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        rank = _env_int(key)
        if rank is not None:
            return rank
    return 0


def global_rank() -> int:
    """torch.distributed's rank once the process group exists, the launcher's before."""
    import torch.distributed as dist  # torch is heavy; the env readers above are used before it loads

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return global_rank_from_env()


# A job id every rank of a launch shares before the rendezvous, from launchers that give one, first found wins:
# our run scripts, torchrun/torchelastic ("none" when not given), OpenMPI/PMIx, SLURM (the job, not its step: ranks
# that mpirun starts through srun carry a step id of their own). The source's name is part of the id, so ranks
# compare ids only when they read the same source (a node whose ranks pdsh started sees no SLURM variables).
LAUNCH_ID_KEYS = ("DSR_LAUNCH_ID", "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "SLURM_JOB_ID")


def launch_id_from_env() -> str:
    """The launcher's job id shared by all ranks, as `SOURCE=VALUE` ('' when no launcher gave one): lets a rank that
    has not joined its job yet tell its own job's store from another job's at the same address
    (training.core.distributed)."""
    for key in LAUNCH_ID_KEYS:
        value = os.environ.get(key, "").strip()
        if value and value != "none":
            return f"{key}={value}"
    return ""


# Every rank's host name, once the job has gathered them (training.checkpoint.shared_folder, before the first step):
# a survivor whose peer vanished names that peer's node and ranks, not just its address (rank_supervisor).
_RANK_HOSTS: list[str] = []


def note_rank_hosts(hosts: list[str]) -> None:
    _RANK_HOSTS[:] = list(hosts)


def ranks_at(address: str) -> tuple[str, list[int]]:
    """(host name, its ranks) of the peer at `address` (an IP a collective's error names): the name this node
    resolves it to; the ranks whose gathered host name is that name or the address itself (none when unknown)."""
    import socket

    try:
        name = socket.gethostbyaddr(address)[0]
    except OSError:
        name = address
    short = name if name == address else name.split(".")[0]
    ranks = [r for r, host in enumerate(_RANK_HOSTS) if host in (name, short, address) or host.split(".")[0] == short]
    return short, ranks
