"""Every rank of a job hears within seconds that another rank failed — on any node — through the key-value store
all ranks already share: torch's TCPStore at MASTER_ADDR:MASTER_PORT, served by rank 0's process.

A launcher sees only its own node: DeepSpeed's launch.py ends its local ranks when one of them fails, but the ranks
of the other nodes wait in their next collective until --comm_timeout (NCCL does not notice a dead peer at all), and
if rank 0 refuses to start (a busy output folder) before it has served the store, the others wait in the
rendezvous. So:

- **Ranks** (`JobWatch.start`, from training.core.distributed before the process group) run a daemon thread with a
  client connection of its own (it probes with a plain socket first, so an absent store costs no log noise). It
  polls ABORT; when another rank's failure is written there it prints `rank R (HOST): stopping: <what happened>` and
  ends the process with status ABORTED. If the store disappears after it was reached — rank 0's process ended — it
  ends the same way (seen on an idle second connection that the server's end closes, so no store call fails and
  torch logs no C++ stack). `close()` stops the thread before a job's normal end (train.py: before the last barrier, so
  rank 0 leaves, taking the store with it, only after every watcher has stopped).
- **Writers** (`publish_abort`): the rank supervisor (training.run.rank_supervisor) when its rank ended
  abnormally — killed by a signal, or exited with an error — with the rank's own `error:` line. The first failure
  written is kept. When the failed rank is rank 0 and it never served the store (it refused before the process
  group: a busy output folder), its supervisor serves one itself, on a free port only, for up to HOLD seconds,
  until every other rank has read the news (the child sends its job id through a pipe once its process group
  exists; after that the store's end is the news).
- **Status** (`publish_stopped`, `stopped_ranks`): a rank paused with SIGSTOP is recorded by its supervisor, so the
  rank whose collective times out can name it.
- **Losses** (`JobWatch.note_loss`, `losses_seen_by`): a survivor whose collective lost a peer records which (its
  node and ranks), so that a survivor whose connection then closes because *that* survivor ended names the lost
  node, not the rank that ended as a consequence (seen on two nodes: rank 1 saw node 1 vanish and ended; rank 0,
  waiting on rank 1, named rank 1's node).
- **A stop before the first step** (`publish_stopping`): a rank that a stop request ends while the data is prepared
  (training.run.stop_request, preparing) has no step's vote to carry it: it writes the signal under STOPPING, and
  every watcher sends its own process that signal, so each rank ends its own preparation (its cleanup included) with
  the same status. Rank 0, whose end takes the store with it, waits until the others have heard (HEAR seconds at
  most); without that a launcher that stops its ranks one by one made the next one say "rank 0's process ended".
- **Only the job's own store** (training.core.job_store: rank 0 names the job in the store it creates; a rank knows
  the name once it has joined): watchers and supervisors act only on the store holding their job's id, so a job
  started on another job's port never writes there. Before joining, a watcher reads only a failed rank 0's news
  store, and a supervisor writes nowhere (unless a launcher's job id shows the store is its own job's).

torch is imported only when needed: the supervisor is a small process without torch until it has news to send.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time

from common import errors
from common.ranks import launch_id_from_env
from training.core import job_store

ABORT = "dsr/abort"
SEEN = "dsr/abort_seen"
STOPPED = "dsr/stopped/"
LOST = "dsr/lost/"  # + rank: the peer that rank lost (JobWatch.note_loss)
NEWS = "dsr/news"  # in a failed rank 0's news store: its launcher's job id (see _serve_news)
ABORTED = errors.ABORTED  # exit status of a rank ended because another rank failed
POLL = 0.5  # seconds between two looks at the store
HOLD = 20.0  # seconds a failed rank 0's supervisor serves the news to ranks that join late
STOPPING = "dsr/stopping"  # the signal that stopped a rank before its first step (see publish_stopping)
STOPPING_SEEN = "dsr/stopping_seen"
HEAR = 5.0  # seconds rank 0 waits for the others to hear of its stop


def _listening(addr: tuple[str, int], timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection(addr, timeout=timeout):
            return True
    except OSError:
        return False


def _client(addr: tuple[str, int], timeout: float = 5.0):
    # a store that ends between the probe and the connection makes torch log each retry with ~30 lines of C++
    # frames (seen after SIGTERM to launch.py); the caller handles the failure, so only fatal logs (read once, when
    # torch loads: the supervisor loads it here)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    return job_store.client(addr[0], addr[1], timeout)


def _connect(addr: tuple[str, int], patience: float):
    """A client of the store, or None when nothing listens there within `patience` seconds."""
    deadline = time.monotonic() + patience
    while True:
        if _listening(addr):
            try:
                return _client(addr)
            except Exception:  # noqa: BLE001 - the store went away between the probe and the connection
                pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.3)


def _holds(store, key: str, value: str) -> bool:
    """Whether `store` holds `value` at `key` (False when it does not, or cannot answer)."""
    try:
        return store.check([key]) and store.get(key).decode() == value
    except Exception:  # noqa: BLE001 - a store that cannot answer is not ours to use
        return False


def _job_connection(addr: tuple[str, int], job: str, patience: float):
    """A client of the store at `addr` if it is job `job`'s store, else None."""
    store = _connect(addr, patience)
    return store if store is not None and _holds(store, job_store.JOB_KEY, job) else None


# ------------------------------------------------------------------------------------------------ writers
READY_FD = "DSR_STORE_READY_FD"  # the supervisor's pipe: the rank writes its job id once it has joined


def mark_store_served() -> None:
    """In a supervised rank, once it has joined its job (its process group exists): tell the supervisor the job's
    id, the only store it may then write into."""
    fd = os.environ.pop(READY_FD, "")
    job = job_store.joined_job()
    if fd.isdigit() and job:
        try:
            os.write(int(fd), job.encode())
            os.close(int(fd))
        except OSError:
            pass


def publish_abort(message: str, rank: int, world: int, job: str | None, patience: float = 10.0) -> bool:
    """Tell every rank of the job that it must stop, and why (`message` names the failed rank). True when told.
    `job`: the failed rank's job id if it joined its job (for rank 0: if its process served the store, whose end the
    others have then seen), else None. Only the job's own store is written into: a rank that never joined writes
    nothing, unless its launcher's id shows the store is its job's (rank 0: only on a free port of its own)."""
    addr = job_store.master_address()
    if addr is None or world <= 1:
        return False
    if rank == 0:
        # the store died with rank 0 (every watcher ends on that already); or it never served one: never write into
        # a store found at the address — it is another job's — but serve the news on the port if it is free
        return False if job else _serve_news(addr, message, world)
    if job:
        store = _job_connection(addr, job, patience)
    else:
        launch = launch_id_from_env()
        store = _connect(addr, patience) if launch else None
        # a job's store (not a failed rank 0's news) whose launcher's id is this rank's
        if store is not None and not (store_names_a_job(store) and _holds(store, job_store.LAUNCH_KEY, launch)):
            store = None
    if store is None:
        return False
    try:
        store.compare_set(ABORT, "", message)  # the first failure is the one every rank reports
        return True
    except Exception:  # noqa: BLE001 - the store ended meanwhile: the others will see that instead
        return False


def store_names_a_job(store) -> bool:
    try:
        return store.check([job_store.JOB_KEY])
    except Exception:  # noqa: BLE001 - a store that cannot answer is not ours to use
        return False


def _serve_news(addr: tuple[str, int], message: str, world: int) -> bool:
    """Rank 0 failed before serving the store: serve one on its port, if that is free, until every other rank has
    read `message` (their watchers acknowledge in SEEN) or HOLD seconds pass. It names no job (no JOB_KEY): NEWS
    holds the launcher's id, and only ranks that have not joined a job listen to it."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(
            addr[0], addr[1], is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
        )
    except Exception:  # noqa: BLE001 - the port is taken (another job's store): write nothing anywhere
        return False
    store.set(NEWS, launch_id_from_env())
    store.set(ABORT, message)
    deadline = time.monotonic() + HOLD
    while time.monotonic() < deadline:
        if store.add(SEEN, 0) >= world - 1:
            break
        time.sleep(0.2)
    time.sleep(0.5)  # let the last reader's connection finish
    return True


def publish_stopped(rank: int, text: str, job: str | None) -> None:
    """Record that `rank` is paused (SIGSTOP) in its job's store (nowhere if it never joined): read by the rank
    whose collective times out."""
    addr = job_store.master_address()
    store = _job_connection(addr, job, 3.0) if addr and job else None
    if store is not None:
        with contextlib.suppress(Exception):  # best effort: the timeout report then says less
            store.set(f"{STOPPED}{rank}", text)


def publish_stopping(signum: int) -> None:
    """This rank stops on request `signum` before its first step: every rank stops so (module docstring)."""
    watch = JobWatch.current
    if watch is None or watch.store is None:
        return
    try:
        with watch._lock:
            watch.stopped_here = True  # its own watcher does not count as a rank that heard
            watch.store.compare_set(STOPPING, "", str(int(signum)))
        deadline = time.monotonic() + HEAR
        while watch.rank == 0 and time.monotonic() < deadline:
            with watch._lock:
                if watch.store.add(STOPPING_SEEN, 0) >= watch.world - 1:
                    break
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store is gone: rank 0 ended, and every watcher sees that already
        pass


# ------------------------------------------------------------------------------------------------ readers
def paused_ranks(store, world: int) -> list[str]:
    """What the supervisors recorded in `store` about paused ranks (texts naming them); [] on any failure."""
    out = []
    try:
        for r in range(world):
            if store.check([f"{STOPPED}{r}"]):
                out.append(store.get(f"{STOPPED}{r}").decode())
    except Exception:  # noqa: BLE001 - best effort: the timeout report then says less
        pass
    return out


def paused_ranks_now(world: int, job: str | None) -> list[str]:
    """`paused_ranks` from a fresh connection to job `job`'s store (for a supervisor, whose rank is gone)."""
    addr = job_store.master_address()
    store = _job_connection(addr, job, 2.0) if addr and job else None
    return paused_ranks(store, world) if store is not None else []


class JobWatch:
    """The watcher thread of one rank (see the module docstring)."""

    current: JobWatch | None = None

    def __init__(self, rank: int, world: int, addr: tuple[str, int]):
        self.rank, self.world, self.addr = rank, world, addr
        self.store = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.stopped_here = False  # this rank published STOPPING (publish_stopping)
        self._thread = threading.Thread(target=self._run, name="job-watch", daemon=True)

    @classmethod
    def start(cls, rank: int, world: int) -> JobWatch | None:
        addr = job_store.master_address()
        if world <= 1 or addr is None or os.environ.get("DSR_JOB_WATCH") == "0":
            return None
        if cls.current is not None and cls.current.addr == addr:
            return cls.current  # one watch per process: a second run in the same job (the tests' driver)
        watch = cls(rank, world, addr)
        watch._thread.start()
        cls.current = watch
        return watch

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=2 * POLL + 1)
        if JobWatch.current is self:
            JobWatch.current = None

    def _end(self, why: str) -> None:
        if self._closing.is_set():
            return
        print(f"rank {self.rank} ({socket.gethostname()}): stopping: {why}", file=sys.stderr, flush=True)
        os._exit(ABORTED)

    def _run(self) -> None:
        self._await_news_until_joined()
        canary = None
        while not self._closing.is_set() and canary is None:
            # the job's own store only (rank 0 named the job in it); None until this rank has joined its job
            job = job_store.joined_job()
            self.store = _job_connection(self.addr, job, POLL) if job else None
            try:
                if self.store is not None:  # idle: readable when the server's end closes
                    canary = socket.create_connection(self.addr, timeout=2.0)
            except OSError:
                self.store = None
            if self.store is None:
                self._closing.wait(POLL)
        while not self._closing.wait(POLL):
            if job_store.closed(canary):
                self._end(
                    f"rank 0's process ended (the job's store at {self.addr[0]}:{self.addr[1]} is gone); its "
                    f"log says why"
                )
                return
            try:
                with self._lock:
                    news = self.store.get(ABORT).decode() if self.store.check([ABORT]) else None
                    if news is not None:
                        self.store.add(SEEN, 1)
                    stopping = None
                    if not self.stopped_here and self.store.check([STOPPING]):
                        stopping = self.store.get(STOPPING).decode()
                        if news is None:
                            self.store.add(STOPPING_SEEN, 1)
            except Exception:  # noqa: BLE001 - the store is gone: rank 0's process ended
                self._end(
                    f"rank 0's process ended (the job's store at {self.addr[0]}:{self.addr[1]} is gone); "
                    f"its log says why"
                )
                return
            if news is not None:
                self._end(news)
                return
            if stopping is not None:
                self._stop_here(int(stopping))
                return

    def _stop_here(self, signum: int) -> None:
        """Another rank stopped on request `signum` before its first step: this process takes the same request
        (its handler ends its preparation), and the store's end that follows is no news."""
        self._closing.set()
        os.kill(os.getpid(), signum)

    def _await_news_until_joined(self) -> None:
        """Before this rank has joined its job, the store at the address may be another job's: listen only to the
        news store a failed rank 0's supervisor serves (NEWS holds this rank's launcher id), and write nothing else."""
        launch, store, canary = launch_id_from_env(), None, None
        while not self._closing.is_set() and job_store.joined_job() is None:
            # that store ended: look again (no call on it: torch would log a C++ stack for each)
            if store is not None and job_store.closed(canary):
                store = canary = None
            if store is None:
                store = _connect(self.addr, POLL)
                try:
                    canary = socket.create_connection(self.addr, timeout=2.0) if store is not None else None
                except OSError:
                    store = None
                if store is None:
                    continue
            try:
                news = store.get(ABORT).decode() if _holds(store, NEWS, launch) and store.check([ABORT]) else None
            except Exception:  # noqa: BLE001 - that store ended: look again
                store = None
                continue
            if news is not None:
                with contextlib.suppress(Exception):
                    store.add(SEEN, 1)  # the news store is no job's: it may be written
                self._end(news)
                return
            self._closing.wait(POLL)

    def note_loss(self, peer: str) -> None:
        """Record in the job's store that this rank lost `peer` (its words for the node and ranks)."""
        if self.store is None:
            return
        with self._lock, contextlib.suppress(Exception):  # the store is gone: nobody is left to read it
            self.store.compare_set(f"{LOST}{self.rank}", "", peer)

    def losses_seen_by(self, ranks: list[int]) -> dict[int, str]:
        """The peers that `ranks` recorded as lost ({rank: its words}); {} when none did or the store is gone."""
        if self.store is None:
            return {}
        seen = {}
        with self._lock, contextlib.suppress(Exception):
            for r in ranks:
                if self.store.check([f"{LOST}{r}"]):
                    seen[r] = self.store.get(f"{LOST}{r}").decode()
        return seen

    def stopped_ranks(self) -> list[str]:
        """What the supervisors recorded about paused ranks, through this rank's connection."""
        if self.store is None:
            return []
        with self._lock:
            return paused_ranks(self.store, self.world)
