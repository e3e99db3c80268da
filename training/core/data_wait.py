"""The ranks of a job meet after data preparation through the job's key-value store (torch's TCPStore), not in a
collective: a first-time token store of a large corpus takes far longer than --comm_timeout, which bounds every
collective. Local rank 0 of each node prepares (builds or verifies) and says so under a key; the node's other ranks
wait for that key before opening the store; then every rank waits until all have their data, so no rank enters the
next collective while another node still builds. Waiting is polling: rank 0 prints a line every REPORT seconds
naming the ranks still preparing. A leader that fails writes its error under FAILED; a waiter that reads it leaves
(normally the job watch, training.run.job_watch, has ended it already with the failed rank's line).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import time
from collections.abc import Iterator

from common.errors import ABORTED, Stopped, UserError
from training.core.job_store import closed, master_address

PREFIX = "dsr/data"
POLL = 0.2
REPORT = 30.0
OTHERS_DELAY = 10.0  # a waiter's own line comes late: the failed rank's line is the one to read
_round = itertools.count()  # every rank prepares the same data sets in the same order: one key space each


def _canary() -> socket.socket | None:
    """An idle connection to the job's store: job_store.closed tells when its server is gone."""
    addr = master_address()
    if addr is None:
        return None
    try:
        return socket.create_connection(addr, timeout=5.0)
    except OSError:
        return None


class DataWait:
    """One round of data preparation (the training set, the validation set) for a job of several processes."""

    def __init__(self, rank: int, world: int, local_rank: int, store):
        self.rank, self.world, self.local_rank, self.store = rank, world, local_rank, store
        self.canary = _canary()
        self.key = f"{PREFIX}/{next(_round)}"
        self.leader = rank - local_rank  # the node's local rank 0 (ranks are node-contiguous)

    @classmethod
    def for_job(cls, local_rank: int) -> DataWait | None:
        """None for a single process (nothing to wait for)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(dist.get_rank(), dist.get_world_size(), local_rank, _get_default_store())

    def _ask(self, call, *args):
        try:
            if self._store_gone():
                raise ConnectionError
            return call(*args)
        except Exception:  # noqa: BLE001 - the store is gone: rank 0's process ended
            raise UserError(
                f"rank {self.rank}: stopping: rank 0's process ended while the data was being prepared; "
                f"its log says why",
                report_delay=OTHERS_DELAY,
                exit_status=ABORTED,
            ) from None

    def _store_gone(self) -> bool:
        """The canary reads its end: asking the store now would fail (the job watch, which sees the same, ends this
        process within a second)."""
        return self.canary is not None and closed(self.canary)

    def _get(self, key: str) -> str | None:
        return self._ask(lambda: self.store.get(key).decode() if self.store.check([key]) else None)

    def _check_failed(self) -> None:
        news = self._get(f"{self.key}/failed")
        if news is not None:
            raise UserError(f"rank {self.rank}: stopping: {news}", report_delay=OTHERS_DELAY, exit_status=ABORTED)

    @contextlib.contextmanager
    def preparing(self, what: str) -> Iterator[None]:
        """Around a leader's preparation: others can see who prepares what; a failure is published."""
        self.store.set(f"{self.key}/busy/{self.rank}", f"rank {self.rank} ({socket.gethostname()}) {what}")
        try:
            yield
        except Stopped:
            raise  # no failure: the others hear of the stop itself (training.run.job_watch)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self.store.compare_set(
                    f"{self.key}/failed",
                    "",
                    f"rank {self.rank} ({socket.gethostname()}) could not prepare the data: {exc}",
                )
                # the waiters read it and stop asking the store before this process (rank 0's: the store's server)
                # ends: a store call that meets the server's end makes torch log a C++ stack on their rank
                time.sleep(3 * POLL)
            raise
        self.store.set(f"{self.key}/ready/{self.rank}", "1")
        self.store.delete_key(f"{self.key}/busy/{self.rank}")

    def from_rank_0(self, compute):
        """What rank 0's `compute()` returns (JSON: lists for tuples), on every rank, through the job's store: the
        others poll for it, as for a build — the first hash of a 40 GB corpus takes a minute, which --comm_timeout
        must not bound, and a rank that waits in Python, not in a collective, takes a stop request at once."""
        key = f"{self.key}/from_rank_0"
        if self.rank == 0:
            value = compute()
            self.store.set(key, json.dumps(value))
            return value
        while (text := self._get(key)) is None:
            time.sleep(POLL)
        return json.loads(text)

    def wait_for_leader(self) -> None:
        """A node's other ranks: until their local rank 0 has the store ready (built or verified)."""
        while self._get(f"{self.key}/ready/{self.leader}") is None:
            self._check_failed()
            time.sleep(POLL)

    def wait_for_all(self) -> None:
        """Every rank: until all ranks have their data. Rank 0 says every REPORT seconds who is still busy."""
        count = self._ask(self.store.add, f"{self.key}/count", 1)
        started = reported = time.monotonic()
        while count < self.world:
            self._check_failed()
            if self.rank == 0 and time.monotonic() - reported >= REPORT:
                reported = time.monotonic()
                busy = [b for b in (self._get(f"{self.key}/busy/{r}") for r in range(self.world)) if b]
                print(
                    f"waiting for the data ({time.monotonic() - started:.0f} s): {count} of {self.world} ranks "
                    f"have it" + (f"; {'; '.join(busy)}" if busy else ""),
                    flush=True,
                )
            time.sleep(POLL)
            count = self._ask(self.store.add, f"{self.key}/count", 0)
