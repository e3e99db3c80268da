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
from common.staging import atomic_write
from training.checkpoint.disk_full import checkpoint_file_guard
from training.checkpoint.latest_pointer import encode, pointer_path, read_name


# ----------------------------------------------------------------------------------------------- paths
def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


BEST = "best"  # the run's best validation checkpoint, outside the rotation
STEP_NAME = re.compile(r"step_\d+")  # what the saves write into `latest`: a step folder's name, no path


def _outside_the_run(ckpt_root: str, name: str, path: str) -> str | None:
    """Why `latest`'s `name` is not a step folder of this run's own (None: it is one). A path in it
    (../../other/checkpoints/step_N, an absolute one) or a link out of the folder would make --resume continue
    another run's weights in this run's folder."""
    if not STEP_NAME.fullmatch(name):
        return f"names {name[:200]!r}, which is not a step_N folder beside it"
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(ckpt_root):
        return f"names {name}, a link to {os.path.realpath(path)}, outside this run's checkpoints"
    return None


def latest_checkpoint(ckpt_root: str, strict: bool = True) -> str | None:
    """The checkpoint `latest` names, or None when there is none. A `latest` naming a missing folder, or anything
    but a step folder of this run (its saves write only a step_N name), is a UserError (strict) or None (for
    messages that only mention it)."""
    pointer = pointer_path(ckpt_root)
    name = read_name(ckpt_root)  # None: no pointer (also one removed between a look and the read)
    if name is None:
        return None
    path = os.path.join(ckpt_root, name)
    outside = _outside_the_run(ckpt_root, name, path)
    if outside is not None:
        if not strict:
            return None
        raise UserError(
            f"{pointer} {outside}: `latest` must name a checkpoint of this run (a step_N folder of "
            f"{ckpt_root}), it was edited or copied from elsewhere. Resume from this run's newest intact "
            f"checkpoint with --resume auto, or name one with --resume {ckpt_root}/step_N (another run's "
            f"checkpoint: --ckpt_file PATH with a new --output_dir)"
        )
    if not os.path.isdir(path):
        if not strict:
            return None
        raise UserError(
            f"{pointer} names {name}, which does not exist (the checkpoint folder was damaged): resume "
            f"from the newest intact checkpoint with --resume auto, or name one with --resume "
            f"{ckpt_root}/step_N"
        )
    return path


def resolve(path: str) -> str:
    """--ckpt_file: a step folder, or a checkpoints/ or output folder (→ its latest)."""
    if not os.path.exists(path):
        raise UserError(f"checkpoint {path} not found")
    if not os.path.isdir(path):
        raise UserError(
            f"checkpoint {path} is a file: give a step_* folder, a checkpoints/ folder or a run's "
            f"output_dir (a .pt from merge_checkpoint.py is already merged, for evaluate.py/export_hf.py)"
        )
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    for root in (path, checkpoints_dir(path)):
        found = latest_checkpoint(root) if os.path.isdir(root) else None
        if found:
            return found
    if path.endswith(".tmp") or any(n.endswith(".tmp") for n in os.listdir(path)):
        raise UserError(f"{path} holds only a partial checkpoint (a save was interrupted); use an earlier one")
    raise UserError(f"{path} is not a checkpoint: no meta.json and no 'latest' pointer in it")


def checkpoint_files(path: str) -> list[str]:
    """The files a load of the checkpoint folder `path` reads — meta.json and those it lists (shards, RNG states, the
    tokenizer copy) — which no command's output may be written over. A meta.json that cannot be read gives itself
    alone (the load then says what is wrong with it)."""
    names = ["meta.json"]
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        listed = [*meta.get("shards", []), *meta.get("rng", []), meta.get("tokenizer")]
        names += [n for n in listed if isinstance(n, str) and n and os.path.basename(n) == n]
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return [os.path.join(path, n) for n in names]


def write_atomic(path: str, write) -> None:
    """`write(f)` into `path` through the fixed staging name `PATH.part`, the one the checkpoint folder's cleanup and
    the disk-full guard know (common.staging: this folder is the run's own, no user's file there)."""
    tmp = path + ".part"
    # out of room: one line, the partial save removed (training.checkpoint.disk_full)
    with checkpoint_file_guard(tmp), atomic_write(path, "wb", staging=tmp) as f:
        write(f)


def point_latest_at(root: str, step: int) -> None:
    """Move `latest` to step_N (the last act of a save, once step_N is complete)."""
    write_atomic(pointer_path(root), lambda f: f.write(encode(step_dirname(step))))


def prune(root: str, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp"))
    for name in done[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(root):  # partial saves left by a crash
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
    found = [
        (step_of(os.path.join(ckpt_root, n)), n)
        for n in os.listdir(ckpt_root)
        if n.startswith("step_") and not n.endswith(".tmp") and os.path.isfile(os.path.join(ckpt_root, n, "meta.json"))
    ]
    return [
        os.path.join(ckpt_root, n) for s, n in sorted(found, key=lambda x: (x[0] is not None, x[0], x[1]), reverse=True)
    ]


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
        raise UserError(
            f"--last {k}: {root} holds {len(found)} complete checkpoint(s); average at most "
            f"{len(found)}, or keep more with train.py --keep_checkpoint_max"
        )
    return [path for _, path in sorted(found)[-k:]]
