"""User-facing errors: one line, no traceback, non-zero exit.

Every command-line entry point of the repository (preprocess tools, run_scripts) wraps its `main` with
`run_cli`, so a user mistake (bad file, bad flag combination, bad parallel layout) prints
`error: <what is wrong and how to fix it>` and exits with status 2, while a genuine bug still shows its traceback.
A full disk (or a file-size limit) met while writing is reported the same way, naming the file.

In a job of several processes every rank usually meets the same mistake at the same moment. Rank 0 reports it at
once; the others wait a little first (`UserError.report_delay`, default `OTHER_RANKS_DELAY` seconds), because the
launcher stops the whole job as soon as one rank exits — so the user reads one line, not one per rank. A rank that
alone meets an error still reports it, a few seconds late.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from common.ranks import world_and_rank_from_env

OTHER_RANKS_DELAY = 3.0
# errors of a write that ran out of room: disk full, quota, and the file-size limit (ulimit -f)
NO_ROOM = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (the file-size limit, ulimit -f, or the filesystem's maximum)",
}


class UserError(Exception):
    """A mistake in the user's input or configuration; the message must name the bad value and the fix.

    `report_delay`: seconds this process waits before printing (None: OTHER_RANKS_DELAY on a
    launched rank other than 0, else 0; the module docstring says why).
    `exit_status`: the process's exit status (2; ABORTED for a rank that stops only
    because another one failed, which is then not reported to the job as a failure of its own)."""

    def __init__(self, message: str, report_delay: float | None = None, exit_status: int = 2):
        super().__init__(message)
        self.report_delay = report_delay
        self.exit_status = exit_status


def _launched_rank() -> int | None:
    """This process's global rank in a launched job of several processes, else None."""
    size, rank = world_and_rank_from_env()
    return rank if size > 1 else None


def no_room_error(exc: BaseException) -> OSError | None:
    """The OSError saying a write ran out of room, if `exc` is one or was caused by one (torch's writer turns it
    into `RuntimeError: ... unexpected pos`, keeping the OSError as its context)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


ABORTED = 3  # exit status of a rank that stops because another rank of its job failed (no news itself)


class Stopped(BaseException):
    """A stop request (SIGTERM and the like) that ends a command where it has nothing to save: its line (printed by
    rank 0 alone, with no `error:`: nothing is wrong) and its exit status (128 + the signal). A BaseException, as
    KeyboardInterrupt is: a handler of ordinary errors on the way up must not take it for one."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


def fail(message: str) -> NoReturn:
    raise UserError(message)


def leave(code: int) -> NoReturn:
    """Leave with `code` — the one exit path of every entry point (run_cli), on success as on error. A rank of a
    launched job leaves at once (os._exit, after flushing): its process group's native threads (gloo/NCCL, the
    TCPStore) are still running, and tearing the interpreter down around them can abort the process ("terminate
    called without an active exception": SIGABRT, exit 134), which the launcher then reports as a failed rank —
    seen at the end of finished runs of the seed-003 demo on 8 ranks and of the tests' 4-rank driver."""
    if _launched_rank() is None:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_cli(main: Callable[[], object]) -> NoReturn:
    if not faulthandler.is_enabled():  # a crash in native code (SIGSEGV, SIGBUS...) prints where it happened
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # a stderr without a file (Jupyter, StringIO)
            faulthandler.enable()
    try:
        result = main()
    except UserError as exc:
        delay = exc.report_delay
        if delay is None:
            delay = OTHER_RANKS_DELAY if _launched_rank() not in (None, 0) else 0.0
        if delay > 0:
            time.sleep(delay)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        leave(exc.exit_status)
    except Exception as exc:  # only a write that ran out of room is turned into a line
        full = no_room_error(exc)
        if full is None:
            raise
        where = f" writing {full.filename}" if full.filename else ""
        print(
            f"error: {NO_ROOM[full.errno]}{where}: free space (or raise the limit), or write to another disk",
            file=sys.stderr,
            flush=True,
        )
        leave(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        leave(130)
    except Stopped as stop:
        if _launched_rank() in (None, 0):  # every rank got the signal: one line for the job
            print(stop, file=sys.stderr, flush=True)
        leave(stop.exit_status)
    leave(int(result or 0))


def console_script(main: Callable[[], object]) -> Callable[[], NoReturn]:
    """The no-argument callable a console script (setup.cfg entry point) calls: `main` under `run_cli`."""

    def entry() -> NoReturn:
        run_cli(main)

    entry.main = main  # (not __wrapped__: inspect would then show main as the entry point's source)
    entry.__doc__ = f"Console script: {main.__module__}.main, user mistakes in one line."
    return entry
