"""The checkpoints/ folder of a run: step names, `latest`, listing, pruning, partial saves, and resolving a path.

    OUTPUT_DIR/checkpoints/
        step_00000020/   a complete checkpoint (training.checkpoint.format); step_N.tmp/ while it is written
        best/            the best validation checkpoint, outside the rotation
        latest           the name of the newest complete step_* checkpoint

Atomicity: files go into `step_N.tmp/`; after every rank has written, rank 0 writes meta.json, renames the folder to
`step_N`, then moves `latest` (write + rename), and only then prunes old checkpoints. A crash at any moment leaves
either the previous complete checkpoint or a `.tmp` folder / `.part` file, which `remove_partial_saves` clears at
the next start (under the output folder's lock, nobody else is writing them). Multi-node runs need OUTPUT_DIR on a
shared filesystem.
"""
from __future__ import annotations

import json
import os
import re
import shutil

from common.errors import UserError
from training.checkpoint.disk_full import checkpoint_file_guard


# ----------------------------------------------------------------------------------------------- paths
def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(ckpt_root: str, strict: bool = True) -> str | None:
    """The checkpoint `latest` names, or None when there is none. A `latest` naming a missing folder is a UserError
    (strict) or None (for messages that only mention it)."""
    pointer = os.path.join(ckpt_root, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(ckpt_root, name)
    if not os.path.isdir(path):
        if not strict:
            return None
        raise UserError(f"{pointer} names {name}, which does not exist (the checkpoint folder was damaged): resume "
                        f"from the newest intact checkpoint with --resume auto, or name one with --resume "
                        f"{ckpt_root}/step_N")
    return path


def resolve(path: str) -> str:
    """--ckpt_file: a step folder, or a checkpoints/ or output folder (→ its latest)."""
    if not os.path.exists(path):
        raise UserError(f"checkpoint {path} not found")
    if not os.path.isdir(path):
        raise UserError(f"checkpoint {path} is a file: give a step_* folder, a checkpoints/ folder or a run's "
                        f"output_dir (a .pt from merge_checkpoint.py is already merged, for evaluate.py/export_hf.py)")
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    for root in (path, checkpoints_dir(path)):
        found = latest_checkpoint(root) if os.path.isdir(root) else None
        if found:
            return found
    if path.endswith(".tmp") or any(n.endswith(".tmp") for n in os.listdir(path)):
        raise UserError(f"{path} holds only a partial checkpoint (a save was interrupted); use an earlier one")
    raise UserError(f"{path} is not a checkpoint: no meta.json and no 'latest' pointer in it")


def write_atomic(path: str, write) -> None:
    tmp = path + ".part"
    # out of room: one line, the partial save removed (training.checkpoint.disk_full)
    with checkpoint_file_guard(tmp):
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def prune(root: str, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp"))
    for name in done[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(root):                              # partial saves left by a crash
        if name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def step_of(path: str) -> int | None:
    match = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(path)))
    if match:
        return int(match.group(1))
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def step_checkpoints(ckpt_root: str) -> list[str]:
    """The step_* checkpoints in a checkpoints/ folder that have a meta.json, newest first (by step)."""
    if not os.path.isdir(ckpt_root):
        return []
    found = [(step_of(os.path.join(ckpt_root, n)), n) for n in os.listdir(ckpt_root)
             if n.startswith("step_") and not n.endswith(".tmp")
             and os.path.isfile(os.path.join(ckpt_root, n, "meta.json"))]
    return [os.path.join(ckpt_root, n) for s, n in sorted(found, key=lambda x: (x[0] is not None, x[0], x[1]),
                                                           reverse=True)]


def saved_checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoints (folders with meta.json) in OUTPUT_DIR/checkpoints, by name."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "meta.json")))


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


def last_checkpoints(run_dir: str, k: int) -> list[str]:
    """The last k complete step_* checkpoints of a run (its output_dir or its checkpoints/ folder), oldest first."""
    # here, not at the top: format imports torch, which the launch scripts' run-folder check (training.plan.
    # launch_check, before every launch) has no use for
    from training.checkpoint.format import read_meta
    if k < 1:
        raise UserError(f"--last {k} must be >= 1")
    root = checkpoints_dir(run_dir) if os.path.isdir(checkpoints_dir(run_dir)) else run_dir
    if not os.path.isdir(root):
        raise UserError(f"{run_dir} not found")
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step_") and not name.endswith(".tmp") and os.path.isfile(os.path.join(path, "meta.json")):
            found.append((read_meta(path)["step"], path))
    if len(found) < k:
        raise UserError(f"--last {k}: {root} holds {len(found)} complete checkpoint(s); average at most "
                        f"{len(found)}, or keep more with train.py --keep_checkpoint_max")
    return [path for _, path in sorted(found)[-k:]]
