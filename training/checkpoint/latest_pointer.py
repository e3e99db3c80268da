"""`latest`: the file in a run's checkpoints/ folder naming its newest complete checkpoint (a step_N folder beside
it, nothing else) — its name and format are known here alone. A save moves it last (training.checkpoint.folder:
point_latest_at); --resume, the checkpoint commands and the disk-full message read it."""

from __future__ import annotations

import os

NAME = "latest"


def pointer_path(ckpt_root: str) -> str:
    return os.path.join(ckpt_root, NAME)


def encode(step_name: str) -> bytes:
    """The pointer's bytes: the step folder's name, no path, no newline."""
    return step_name.encode()


def read_name(ckpt_root: str) -> str | None:
    """What the pointer names, as written (undecodable bytes replaced: a damaged pointer is still named in the
    messages), or None when there is no pointer."""
    try:
        with open(pointer_path(ckpt_root), "rb") as f:
            return f.read().decode("utf-8", "replace").strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
