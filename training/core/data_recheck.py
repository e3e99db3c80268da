"""The full sha256 of the data files a start took on trust, checked once per job beside the first steps.

A start takes the corpus's recorded sha256 (preprocess.tsv_digest) and the token store's verdict
(preprocess.token_store) when size, time and a 1 MiB sample of each file are the recorded ones; those files are noted
in preprocess.trusted_files. `DataRecheck.start()` hashes them in full on a thread of the process that noted them
(global rank 0 for the corpus, each node's local rank 0 for its store), at low priority, while training runs. After
each step `after_step` looks whether the thread has finished: a file that no longer matches stops this rank with
one `error:` line naming the file and the fix, and the job watch (training.run.job_watch) stops the others. Before
the last step's save every rank waits for every check, on the job's store and not in a collective (a 40 GB corpus is
a minute of hashing, which --comm_timeout must not bound: training.core.data_wait), so that no run ends with its
checkpoint of data nobody checked.
"""

from __future__ import annotations

import contextlib
import os
import threading

from common.errors import UserError
from common.ranks import local_rank_from_env
from preprocess.trusted_files import first_mismatch, take
from training.core.data_wait import DataWait

NICE = 10  # the thread's niceness: the steps' own threads come first on a busy CPU


class DataRecheck:
    def __init__(self, files: list):
        self.files = files
        self.problem: str | None = None
        self.thread: threading.Thread | None = None

    @classmethod
    def start(cls) -> DataRecheck:
        """The check of what this process trusted so far (train and validation data), started on its thread."""
        check = cls(take())
        if check.files:
            check.thread = threading.Thread(target=check._run, name="data-recheck", daemon=True)
            check.thread.start()
        return check

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # per thread on Linux; elsewhere it keeps its priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        self.problem = first_mismatch(self.files)

    def _raise_if_bad(self, step: int) -> None:
        if self.problem:
            raise UserError(f"stopped after step {step}: {self.problem}")

    def after_step(self, step: int, last: bool) -> None:
        """A finished check that failed stops the run here; `last` (the step the run ends or saves its last after,
        the same on every rank) waits for every rank's check first."""
        if last:
            self._wait_everywhere(step)
        elif self.thread is not None and not self.thread.is_alive():
            self._raise_if_bad(step)

    def _wait_everywhere(self, step: int) -> None:
        wait = DataWait.for_job(local_rank_from_env())
        mine = self.thread is not None
        with wait.preparing("checks the sha256 of its data files") if wait and mine else contextlib.nullcontext():
            if mine:
                if self.thread.is_alive():  # a short run on a large corpus: say why its end waits
                    print(
                        f"step {step}: waiting for the full sha256 check of {len(self.files)} data file(s) this "
                        f"start took on their record, before the last save",
                        flush=True,
                    )
                self.thread.join()
                self._raise_if_bad(step)
        if wait:
            wait.wait_for_all()
