"""Which job a store at MASTER_ADDR:MASTER_PORT belongs to, so that two jobs that meet at one address (the same
master port on one node) never read or write each other's records (docs/failures.md#jobs-sharing-a-node).

Rank 0 creates the job's TCPStore itself, before torch's rendezvous, and writes a fresh job id into it (JOB_KEY)
with the launcher's shared id, if any (LAUNCH_KEY); torch's env:// rendezvous then reuses that server (multi_tenant:
one server per port and process). A busy port is one line here, instead of torch's DistNetworkError traceback.
Another rank first takes its seat in the store (SEAT_KEY + its rank, compare_set: a store whose seat is taken is
another job's, which is then only read) and refuses a store whose launcher's id (common.ranks.launch_id_from_env)
is not its own; once its process group exists it is "joined" to the job named there. The job watch and the rank
supervisors (training.run.job_watch) act only on the store holding their job's id; an unjoined rank writes nothing.
"""

from __future__ import annotations

import datetime
import os
import select
import socket
import time
import uuid

from common.errors import UserError
from common.ranks import launch_id_from_env

# torchrun's agent serves the store and keeps it over restarts: each attempt names its own job
_ATTEMPT = f"/{os.environ['TORCHELASTIC_RESTART_COUNT']}" if os.environ.get("TORCHELASTIC_RESTART_COUNT") else ""
JOB_KEY = f"dsr/job{_ATTEMPT}"
LAUNCH_KEY = f"dsr/launch{_ATTEMPT}"
SEAT_KEY = f"dsr/seat{_ATTEMPT}/"  # + rank: taken by that rank (a random value) before its rendezvous
# seconds a store may take to show its launch id after it answers (rank 0 writes it at once)
LAUNCH_WAIT = 10.0

_job: str | None = None  # this process's job id, once joined
_pending: str | None = None  # the job id of the store this rank took its seat in, until the rendezvous is done
_server = None  # rank 0: the store object that keeps the server alive while torch's rendezvous reuses it


def joined_job() -> str | None:
    """This process's job id: rank 0's from the moment its store exists, another rank's once its group exists."""
    return _job


def _use_libuv() -> bool:
    return os.environ.get("USE_LIBUV", "1") == "1"  # as torch's env:// rendezvous decides it


def busy_port_error(addr: str, port: int) -> UserError:
    return UserError(
        f"the master port {port} at {addr} is in use (another job's rendezvous?): start this job on "
        f"another port — `deepspeed --master_port N`, or MASTER_PORT=N for mpirun/torchrun (run.sh "
        f"and run_cluster.sh take a free one when MASTER_PORT is unset)"
    )


def master_address() -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) of this process's job, or None when the launcher gave none."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    return (addr, int(port)) if addr and port.isdigit() else None


def closed(canary: socket.socket) -> bool:
    """Whether the server's end of an idle connection (a "canary" to the store) closed: it is then readable, with
    nothing to read. A store call that meets the server's end would make torch log a C++ stack instead."""
    if not select.select([canary], [], [], 0)[0]:
        return False
    try:
        return not canary.recv(1)
    except OSError:
        return True


def client(addr: str, port: int, timeout: float):
    from torch.distributed import TCPStore

    return TCPStore(
        addr,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        use_libuv=_use_libuv(),
    )


def create(addr: str, port: int, timeout: float) -> str:
    """Rank 0, before the rendezvous: serve the job's store on `port` and name the job in it; returns the job id."""
    global _job, _server
    if _server is not None:
        return _job  # a second run in the same process (the tests' driver)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = client(addr, port, timeout)  # torchrun's agent serves this job's store (torch's rendezvous knows)
    else:
        store = _serve(addr, port, timeout)
    job = uuid.uuid4().hex
    store.set(LAUNCH_KEY, launch_id_from_env())
    store.set(JOB_KEY, job)  # last: a store with a job id also has its launch id
    _server, _job = store, job
    return job


def _serve(addr: str, port: int, timeout: float):
    from torch.distributed import DistNetworkError, TCPStore

    try:
        return TCPStore(
            addr,
            port,
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
            use_libuv=_use_libuv(),
        )
    except DistNetworkError as exc:
        if "EADDRINUSE" in str(exc) or "already in use" in str(exc):
            raise busy_port_error(addr, port) from None
        raise


def launch_of(store, patience: float = LAUNCH_WAIT) -> str | None:
    """The launch id a job's store holds; None if it names no job within `patience` s (a failed rank 0's news,
    training.run.job_watch, or not a store of this repository)."""
    deadline = time.monotonic() + patience
    while not store.check([JOB_KEY]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
    return store.get(LAUNCH_KEY).decode()


def check_before_rendezvous(addr: str, port: int, rank: int, timeout: float) -> None:
    """A rank other than 0, before torch's rendezvous writes into the store (gloo's rendezvous sets this rank's
    address there, and a rendezvous that completed in another job's store would make this rank one of its ranks):
    take this rank's seat in the job's store — a store whose seat is taken is another job's (its rank `rank` joined
    it earlier) — and, with a launcher's job id, refuse a store its id says is another job's. A failed
    compare_set changes nothing: the other job's store is only read."""
    global _pending
    if _job is not None:
        return  # a second run in the same process (the tests' driver)
    store = client(addr, port, timeout)
    theirs = launch_of(store)
    if theirs is None:
        return  # no job named there: a failed rank 0's news (the job watch hears it), or not ours
    mine = launch_id_from_env()
    if mine and theirs.partition("=")[0] == mine.partition("=")[0] and theirs != mine:
        raise _another_job(addr, port, f"its launcher's job id is {theirs}; this rank's is {mine}")
    nonce = uuid.uuid4().hex
    if store.compare_set(f"{SEAT_KEY}{rank}", "", nonce).decode() != nonce:
        raise _another_job(addr, port, f"its rank {rank} joined it before this one")
    _pending = store.get(JOB_KEY).decode()


# this job's rank 0 met the same port (busy): its line first; its launcher ends us meanwhile
ANOTHER_JOB_DELAY = 10.0


def _another_job(addr: str, port: int, why: str) -> UserError:
    return UserError(
        f"the store at MASTER_ADDR:MASTER_PORT {addr}:{port} belongs to another job ({why}): start this "
        f"job on another port — `deepspeed --master_port N`, or MASTER_PORT=N",
        report_delay=ANOTHER_JOB_DELAY,
    )


def join(addr: str, port: int, timeout: float) -> str:
    """A rank other than 0, once its process group exists: it has joined the job whose store it took a seat in."""
    global _job
    if _job is None:
        _job = _pending or client(addr, port, timeout).get(JOB_KEY).decode()
    return _job
