"""One builder per artefact (a token store, an auto-built tokenizer) across processes and nodes that share its folder.

`one_builder(target, what, done)` takes an exclusive `flock` on `<folder>/.<name>.lock` before building; a process
that finds it taken waits — polling, with a line every WAIT_REPORT seconds naming who builds what — until the holder
lets go, then looks again: `done()` true means the other process built it and there is nothing left to do. flock is
released by the kernel when its holder dies (kill -9 included), so a killed builder leaves no stale lock: the next
waiter takes it and builds. The holder deletes the lock file before letting go; a waiter that then locks the
deleted file notices (another inode under the name) and tries again. Where the lock file cannot be made (a read-only
folder) the build goes on unlocked and fails with its own one-line error. flock over NFS: Linux maps it to NFS byte-
range locks (NFSv4, or v3 with lockd) that hold across clients; Lustre needs the `flock` mount option (docs/data.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

POLL = 0.5
WAIT_REPORT = 30.0


def lock_path(target: Path) -> Path:
    target = Path(target)
    return target.parent / f".{target.name}.lock"


def _holder(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip() or "another process"
    except OSError:
        return "another process"


def _take(path: Path) -> int | None:
    """The lock file's descriptor, locked by this process; None while another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # the last holder deleted the file we locked: a stale name
        os.close(fd)
        return None
    return fd


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


@contextlib.contextmanager
def one_builder(
    target: Path, what: str, done: Callable[[], bool], say: Callable[[str], None] = lambda line: print(line, flush=True)
) -> Iterator[bool]:
    """Yields True when this process must build `target` (holding the lock until the block ends), False when
    another process built it while this one waited. `what` names it in the waiting lines."""
    path = lock_path(target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _take(path)
    except OSError:
        fd = -1
    if fd == -1:
        yield True  # no lock here (read-only folder): the build says why it fails
        return
    started = time.monotonic()
    reported = started
    while fd is None:
        if done():
            yield False
            return
        if time.monotonic() - reported >= WAIT_REPORT:
            reported = time.monotonic()
            say(
                f"waiting for {what}: {_holder(path)} is building it (waited {_minutes(reported - started)}; "
                f"lock {path})"
            )
        time.sleep(POLL)
        fd = _take(path)
    try:
        if done():  # built by the holder we waited for
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} pid {os.getpid()} (since {time.strftime('%H:%M:%S')})".encode())
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # before the unlock: a waiter then finds the name gone, not stale
        os.close(fd)
