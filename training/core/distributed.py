"""The process group: join the launcher's (deepspeed, mpirun, torchrun) or make a one-process one, and the device.

Everything about *which* process this is and how it meets the others lives here; the engine module builds the
model and optimizer on top of it.
"""

from __future__ import annotations

import os
import socket

import torch

from common import slurm
from common.errors import UserError
from common.ranks import world_and_rank_from_env
from model.parallel.topology import init_deepspeed_comm
from training.core import job_store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def adopt_mpi_env(environ=os.environ) -> bool:
    """Ranks started by mpirun (DeepSpeed's `--launcher openmpi`) get OMPI_COMM_WORLD_*, not the RANK / WORLD_SIZE /
    LOCAL_RANK that torch reads: copy them over. MASTER_ADDR / MASTER_PORT must come from `mpirun -x` (the launch
    scripts pass them), so no mpi4py is needed. Returns True when it adopted an MPI environment."""
    if "WORLD_SIZE" in environ or "OMPI_COMM_WORLD_SIZE" not in environ:
        return False
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if missing:
        raise UserError(
            f"started by mpirun without {' and '.join(missing)}: export them to every rank, e.g. "
            f"mpirun -x MASTER_ADDR=<address of the first host> -x MASTER_PORT=29500 "
            f"(run_scripts/run.sh and run_cluster.sh --launcher openmpi do this)"
        )
    environ.update(
        RANK=environ["OMPI_COMM_WORLD_RANK"],
        WORLD_SIZE=environ["OMPI_COMM_WORLD_SIZE"],
        LOCAL_RANK=environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        LOCAL_SIZE=environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
    )
    return True


def init_distributed(
    distribute: str, comm_timeout: float | None = None, before_rendezvous=None, after_rendezvous=None
) -> int:
    """Join the launcher's process group (or make a one-process one); returns the world size. `comm_timeout`:
    seconds any collective waits for its peers before failing (model.parallel.topology.init_deepspeed_comm).
    `before_rendezvous(rank, world)`: called before the rendezvous in a job of several processes, `after_rendezvous()`
    once the process group exists and this rank has joined its job
    (job_store.joined_job(); the job watch: training.run.job.join_job)."""
    import deepspeed.comm as ds_dist

    if distribute != "false":
        adopt_mpi_env()  # (first: mpirun started inside an allocation is a launcher of its own)
        slurm.adopt()  # srun's tasks (train.py adopts earlier, before its rank supervisor)
    launched = "WORLD_SIZE" in os.environ
    if distribute == "true" and not launched:
        raise UserError(
            "--distribute true needs a launcher: run it under `deepspeed --num_gpus N`, "
            "`deepspeed --hostfile H`, mpirun or torchrun (or use --distribute false for one process)"
        )
    if distribute == "false" or not launched:
        if launched and int(os.environ["WORLD_SIZE"]) > 1:
            raise UserError(
                f"--distribute false but the launcher started {os.environ['WORLD_SIZE']} processes; "
                "use --distribute true (or auto)"
            )
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    world, rank = world_and_rank_from_env()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    several = world > 1 and bool(addr) and port.isdigit()  # (without them torch's rendezvous says so)
    if several:
        # the job's identity, before the rendezvous: rank 0 serves the store (a busy port is one line) and names the
        # job in it; another rank takes its seat there, refusing another job's store (training.core.job_store)
        port = int(port)
        store_timeout = comm_timeout if comm_timeout is not None else 1800.0  # torch's default_pg_timeout
        if before_rendezvous is not None:  # first: a failed rank 0's news reaches a rank waiting for its seat
            before_rendezvous(rank, world)
        if rank == 0:
            job_store.create(addr, port, store_timeout)
        else:
            job_store.check_before_rendezvous(addr, port, rank, store_timeout)
    from deepspeed.accelerator import get_accelerator

    backend = get_accelerator().communication_backend_name()
    if backend == "ccl":  # DeepSpeed's CPU accelerator names oneCCL; plain gloo needs nothing
        backend = "gloo"
    init_deepspeed_comm(backend, comm_timeout)
    if several:
        job_store.join(addr, port, store_timeout)
    if after_rendezvous is not None:
        after_rendezvous()
    acc = get_accelerator()
    if acc.device_name() == "cuda":
        acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return ds_dist.get_world_size()


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
