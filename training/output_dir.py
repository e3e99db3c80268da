"""OUTPUT_DIR belongs to one run at a time, and a run starts where its checkpoints say.

`claim_output_dir(args)` runs on global rank 0 before anything else (before the process group, the data and the
model), so every mistake here costs seconds and prints one line:

- the folder must be a folder that can be written, and what train.py writes inside it (checkpoints/, tensorboard/,
  metrics.jsonl, run.json) must not be the wrong kind (a file where a folder goes, or the reverse);
- a lock: `OUTPUT_DIR/.train.lock`, held with flock(2) by rank 0 for the whole run. The kernel drops it when the
  process ends, however it ends, so a crash never leaves a stale lock. A second run into the same folder is refused
  with the holder's pid and host, before it has touched anything;
- the start point (`resume_source`): a fresh run into a folder that already holds checkpoints is refused (its saves
  would replace them and `latest` would jump between two histories), and so is a run from a checkpoint elsewhere,
  or from an older checkpoint of this folder while newer ones exist. `--resume` continues the folder's own run;
- partial saves a crash or a full disk left (`checkpoints/*.tmp`, `*.part`) are removed: with the lock held,
  nobody else can be writing them.

`resume_source(args)` is also what train.py loads: `--resume` (the folder's latest), `--resume auto` (the latest,
or `--ckpt_file`, or nothing), `--resume PATH` (that checkpoint), `--ckpt_file PATH`.

`drop_records_after(metrics.jsonl, step)` makes a resumed run's log hold every step once: the records of steps
after the checkpoint (the ones the run is about to replay) are removed when it starts.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import shutil
import socket
from typing import Optional

from preprocess.errors import UserError

LOCK_NAME = ".train.lock"
FOLDERS = ("checkpoints", "tensorboard")          # what train.py writes inside OUTPUT_DIR, by kind
FILES = ("metrics.jsonl", "run.json")
AUTO = "auto"
LATEST = "latest"                                 # --resume without a value


def global_rank_from_env() -> int:
    """The global rank a launcher gave this process (0 for a plain `python train.py`); known before the process
    group exists."""
    for key in ("RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(key, "").strip().isdigit():
            return int(os.environ[key])
    return 0


# ------------------------------------------------------------------------------------------- the folder itself
def check_writable_folder(output_dir: str) -> str:
    """Create OUTPUT_DIR if needed; UserError when it, or a folder above it, is a file, or it cannot be written."""
    path = os.path.abspath(output_dir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"cannot be created: {existing} is a file, not a folder"
        raise UserError(f"--output_dir {output_dir} {where}; choose a folder for the run's checkpoints and logs")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--output_dir {output_dir} cannot be created ({exc.strerror}); choose a folder you can "
                        f"write to")
    for name in FOLDERS:
        inside = os.path.join(path, name)
        if os.path.exists(inside) and not os.path.isdir(inside):
            raise UserError(f"--output_dir {output_dir}: {inside} is a file, but train.py writes a folder there; "
                            f"move it away or choose another --output_dir")
    for name in FILES:
        inside = os.path.join(path, name)
        if os.path.isdir(inside):
            raise UserError(f"--output_dir {output_dir}: {inside} is a folder, but train.py writes a file there; "
                            f"move it away or choose another --output_dir")
    return path


# ------------------------------------------------------------------------------------------------------ lock
class OutputDirLock:
    """flock(2) on OUTPUT_DIR/.train.lock; the file says who holds it (pid, host, since)."""

    def __init__(self, folder: str, output_dir: str):
        self.path = os.path.join(folder, LOCK_NAME)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"--output_dir {output_dir} cannot be written ({exc.strerror} creating {LOCK_NAME}); "
                            f"choose a folder you can write to")
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self._fd)
            raise UserError(f"--output_dir {output_dir} is in use by another training run ({holder}); wait for it "
                            f"to finish or stop it, or choose another --output_dir") from None
        except OSError as exc:       # a filesystem without flock (some network mounts): run unlocked, say so
            print(f"warning: cannot lock {self.path} ({exc.strerror}); make sure no other run writes to "
                  f"{output_dir}", flush=True)
        since = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)

    def _holder(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read().strip() or "pid unknown"
        except OSError:
            return "pid unknown"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)                     # closing the descriptor drops the lock
            self._fd = None


# ------------------------------------------------------------------------------------------- the start point
def resume_source(args) -> Optional[str]:
    """The checkpoint folder this run starts from, or None for a fresh start (UserError when there is none where
    the flags say there must be one)."""
    from training import checkpoint as ckpt
    resume, ckpt_file = args.resume, args.ckpt_file
    if resume not in (None, AUTO, LATEST):                     # --resume PATH
        if ckpt_file:
            raise UserError(f"--resume {resume} and --ckpt_file {ckpt_file} both name a checkpoint; give one")
        return ckpt.resolve(resume)
    if resume is not None:
        root = ckpt.checkpoints_dir(args.output_dir)
        found = ckpt.latest_checkpoint(root) if os.path.isdir(root) else None
        if found:
            return found
        if ckpt_file:
            return ckpt.resolve(ckpt_file)
        if resume != AUTO:
            raise UserError(f"--resume: no checkpoint in {root}; use --resume auto to start fresh when there "
                            f"is none, or --ckpt_file PATH")
        return None
    return ckpt.resolve(ckpt_file) if ckpt_file else None


def _step_of(path: str) -> Optional[int]:
    match = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(path)))
    if match:
        return int(match.group(1))
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoints (folders with meta.json) in OUTPUT_DIR/checkpoints, by name."""
    from training import checkpoint as ckpt
    root = ckpt.checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "meta.json")))


def check_start_point(args, source: Optional[str]) -> None:
    """Refuse a start that would mix two histories in OUTPUT_DIR's checkpoints (see the module docstring)."""
    from training import checkpoint as ckpt
    saved = saved_checkpoints(args.output_dir)
    if not args.train or not saved:
        return
    root = os.path.realpath(ckpt.checkpoints_dir(args.output_dir))
    steps = [(_step_of(n), n) for n in saved if n.startswith("step_")]                         # not best/
    newest = max(((s, n) for s, n in steps if s is not None), default=None)
    what = f"checkpoints up to {newest[1]}" if newest else f"checkpoints ({', '.join(saved[:3])})"
    if source is None:
        raise UserError(f"--output_dir {args.output_dir} already holds {what} and this run starts fresh: its saves "
                        f"would replace them. Continue that run with --resume (or --resume auto), or choose "
                        f"another --output_dir")
    source_real = os.path.realpath(source)
    own_latest = ckpt.latest_checkpoint(root)
    if own_latest and os.path.realpath(own_latest) == source_real:
        return                                                 # the folder's own run continues
    if os.path.dirname(source_real) != root:
        raise UserError(f"--output_dir {args.output_dir} already holds {what} of its own; continuing {source} "
                        f"there would mix two runs. Choose another --output_dir (or pass --resume alone to "
                        f"continue {args.output_dir}'s own run)")
    step = _step_of(source_real)
    if newest is not None and step is not None and step < newest[0]:
        raise UserError(f"{source} is step {step}, but {args.output_dir} also holds later checkpoints (up to "
                        f"{newest[1]}) that this run would overwrite one by one. Start from it in another "
                        f"--output_dir, or move the later checkpoints away first")


def claim_output_dir(args) -> Optional[OutputDirLock]:
    """On global rank 0: the folder, the lock, the start point — before any other work. Other ranks: None (rank 0
    decides for the job; if it refuses, the launcher stops the others)."""
    if global_rank_from_env() != 0:
        return None
    folder = check_writable_folder(args.output_dir)
    lock = OutputDirLock(folder, args.output_dir)
    try:
        check_start_point(args, resume_source(args))
    except BaseException:
        lock.release()
        raise
    remove_partial_saves(folder)
    return lock


def remove_partial_saves(folder: str) -> None:
    """checkpoints/*.tmp folders and *.part files are saves a crash or a full disk interrupted: never loadable,
    and (the lock is held) nobody is writing them."""
    root = os.path.join(folder, "checkpoints")
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.endswith(".tmp") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".part") and os.path.isfile(path):
            os.remove(path)


# ------------------------------------------------------------------------------------------------ metrics log
def drop_records_after(path: str, step: int) -> int:
    """Remove the records of steps after `step` (and any torn last line) from a metrics.jsonl; returns how many
    lines went. The file is rewritten atomically, so a crash now leaves the old or the new file."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
            if isinstance(record, dict) and int(record.get("step", 0)) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, TypeError):
            pass                                   # a line a crash cut short
    dropped = len(lines) - len(keep)
    if dropped:
        tmp = path + ".part"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return dropped
