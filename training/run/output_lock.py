"""OUTPUT_DIR belongs to one run at a time.

`claim_output_dir(section)` runs on global rank 0 before anything else (before the process group, the data and the
model), so every mistake here costs seconds and prints one line:

- the folder must be a folder that can be written, and what train.py writes inside it (checkpoints/, tensorboard/,
  metrics.jsonl, run.json) must not be the wrong kind (a file where a folder goes, or the reverse);
- a lock: `OUTPUT_DIR/.train.lock`, held with flock(2) by rank 0 for the whole run. The kernel drops it when the
  process ends, however it ends, so a crash never leaves a stale lock. A second run into the same folder is refused
  with the holder's pid and host, before it has touched anything;
- the start point is then decided under the lock, once the process group exists (training.run.start_point);
- partial saves a crash or a full disk left (`checkpoints/*.tmp`, `*.part`) are removed: with the lock held,
  nobody else can be writing them;
- a run that ends before it has written anything (a mistake in its flags, its data or its layout; a stop request
  while its data is prepared) leaves nothing it made: `undo()` deletes the lock file if the run created it, and the
  folders it created while they are empty (`dstr-train` with no arguments made ./out/train/.train.lock).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket

from common.errors import UserError
from common.ranks import global_rank_from_env
from common.user_files import nearest_existing
from training.checkpoint.folder import remove_partial_saves
from training.config.sections import CheckpointSection

LOCK_NAME = ".train.lock"


FOLDERS = ("checkpoints", "tensorboard")  # what train.py writes inside OUTPUT_DIR, by kind


FILES = ("metrics.jsonl", "run.json")


# ------------------------------------------------------------------------------------------- the folder itself
def check_writable_folder(output_dir: str) -> str:
    """Create OUTPUT_DIR if needed; UserError when it, or a folder above it, is a file, or it cannot be written."""
    path = os.path.abspath(output_dir)
    existing = str(nearest_existing(path))
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"cannot be created: {existing} is a file, not a folder"
        raise UserError(f"--output_dir {output_dir} {where}; choose a folder for the run's checkpoints and logs")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"--output_dir {output_dir} cannot be created ({exc.strerror}); choose a folder you can write to"
        ) from exc
    for name in FOLDERS:
        inside = os.path.join(path, name)
        if os.path.exists(inside) and not os.path.isdir(inside):
            raise UserError(
                f"--output_dir {output_dir}: {inside} is a file, but train.py writes a folder there; "
                f"move it away or choose another --output_dir"
            )
    for name in FILES:
        inside = os.path.join(path, name)
        if os.path.isdir(inside):
            raise UserError(
                f"--output_dir {output_dir}: {inside} is a folder, but train.py writes a file there; "
                f"move it away or choose another --output_dir"
            )
    return path


def _missing_folders(path: str) -> tuple:
    """The folders of `path` that do not exist yet, deepest first: what creating it makes."""
    missing = []
    while path and not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return tuple(missing)


# ------------------------------------------------------------------------------------------------------ lock
class OutputDirLock:
    """flock(2) on OUTPUT_DIR/.train.lock; the file says who holds it (pid, host, since)."""

    def __init__(self, folder: str, output_dir: str, created: tuple = ()):
        self.path = os.path.join(folder, LOCK_NAME)
        self.created = created  # the folders this run made, deepest first (undo removes them)
        self.made_file = False
        while not self._lock(output_dir):  # a run that undid its start deleted the file we locked: again
            pass
        since = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)

    def _open(self, output_dir: str) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self.made_file = True
            return fd
        except FileExistsError:
            pass
        except OSError as exc:
            raise UserError(
                f"--output_dir {output_dir} cannot be written ({exc.strerror} creating {LOCK_NAME}); "
                f"choose a folder you can write to"
            ) from exc
        try:
            return os.open(self.path, os.O_RDWR)
        except FileNotFoundError:  # deleted between the two opens (undo): make it anew
            return self._open(output_dir)
        except OSError as exc:
            raise UserError(
                f"--output_dir {output_dir} cannot be written ({exc.strerror} opening {LOCK_NAME}); "
                f"choose a folder you can write to"
            ) from exc

    def _lock(self, output_dir: str) -> bool:
        """Lock the file at self.path; False when the file locked is no longer the one there (deleted by a run's
        undo between our open and our lock: two runs would each hold a lock of their own)."""
        self._fd = self._open(output_dir)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self._fd)
            raise UserError(
                f"--output_dir {output_dir} is in use by another training run ({holder}); wait for it "
                f"to finish or stop it, or choose another --output_dir"
            ) from None
        except OSError as exc:  # a filesystem without flock (some network mounts): run unlocked, say so
            print(
                f"warning: cannot lock {self.path} ({exc.strerror}); make sure no other run writes to {output_dir}",
                flush=True,
            )
            return True
        try:
            same = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(self._fd)
            self.made_file = False
        return same

    def undo(self) -> None:
        """The run ends before it wrote anything: delete the lock file if this run made it (while still holding it:
        a run that opened it meanwhile finds another file under the name, see _lock), release it, and remove the
        folders this run made, while they are empty."""
        if self._fd is None:
            return
        if self.made_file:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.release()
        for folder in self.created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)

    def _holder(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read().strip() or "pid unknown"
        except OSError:
            return "pid unknown"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def claim_output_dir(section: CheckpointSection) -> OutputDirLock | None:
    """On global rank 0: the folder and the lock — before any other work. Other ranks: None (rank 0 decides for the
    job; if it refuses, the launcher stops the others)."""
    if global_rank_from_env() != 0:
        return None
    created = _missing_folders(os.path.abspath(section.output_dir))
    folder = check_writable_folder(section.output_dir)
    lock = OutputDirLock(folder, section.output_dir, created)
    remove_partial_saves(folder)
    return lock
