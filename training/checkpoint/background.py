"""Background saves: a save's files are written and hashed on a thread while training goes on, and the save is
committed (meta.json, rename, `latest`, pruning: rank 0) only once every rank's files are written.

One save at most is in flight. Its phases, the same on every rank:

    writing      each rank's thread writes its files from the snapshot (training.checkpoint.snapshot) and hashes them
    committing   every rank said its files are written; rank 0's thread commits
    (none)       `drain()` waited for both and every rank passed a barrier: `latest` is the same on every rank

`poll()` runs at every step boundary on every rank: while the save is writing, one all-reduce (MIN) of "my files are
written" — a number, not a wait — and when every rank says so, the commit starts. `drain()` is the blocking form,
called before the next save, a named or final save, a save on a stop signal, and any reading of `latest`.

A thread's failure (a full disk: one line from training.checkpoint.disk_full) is raised on that rank's main thread at
its next poll or drain; the other ranks then wait in a collective until the launcher ends them, as when a synchronous
save fails on one rank. The thread never calls a collective: they stay on the main thread, in the same order on every
rank. It is a daemon: a process that ends while a save is in flight leaves `step_N.tmp/`, and the previous checkpoint
stays `latest`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from training.checkpoint.snapshot import Staging


class BackgroundSaves:
    def __init__(self, device):
        self.device = device
        self.staging = Staging()
        self._phase: str | None = None  # None | "writing" | "committing"
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._commit: Callable[[], None] | None = None

    @property
    def in_flight(self) -> bool:
        return self._phase is not None

    def start(self, write: Callable[[], None], commit: Callable[[], None] | None) -> None:
        """Write this rank's files on the thread; `commit`: rank 0's, None elsewhere."""
        assert self._phase is None, "a save is already in flight: drain() first"
        self._phase, self._commit = "writing", commit
        self._run(write)

    def _run(self, job: Callable[[], None]) -> None:
        def target():
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - raised again on the main thread (_raise)
                self._error = exc

        self._thread = threading.Thread(target=target, name="checkpoint-save", daemon=True)
        self._thread.start()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._phase = None
            raise error

    def poll(self) -> None:
        """At a step boundary, every rank: start the commit once every rank's files are written. Never waits for a
        write."""
        if self._phase == "committing" and not self._thread.is_alive():
            self._raise()  # rank 0's commit failed: say so now, not at the next save
        if self._phase != "writing":
            return
        written = not self._thread.is_alive()  # the thread records its error before it ends
        if written:
            self._raise()
        flag = torch.tensor([int(written)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()):
            self._phase = "committing"
            if self._commit is not None:
                self._run(self._commit)

    def drain(self) -> None:
        """Every rank, the same point: wait until the save in flight (if any) is written everywhere and committed."""
        if self._phase is None:
            return
        self._thread.join()
        self._raise()
        if self._phase == "writing":
            dist.barrier()  # every rank's files are written
            if self._commit is not None:
                self._commit()
        dist.barrier()  # committed: `latest` reads the same on every rank
        self._phase, self._commit, self._thread = None, None, None
