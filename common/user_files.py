"""Files a user names on a command line, checked before any work.

- `read_json(path, what)`: a JSON file (recipe, rank table, DeepSpeed config), each mistake one `UserError` line.
- `check_output_file(path, what)`, `refuse_output_over_inputs(output, what, inputs)`: an output that can be written
  and is none of the command's inputs (not even through a link or another spelling).
- `nearest_existing(path)`, `same_file(a, b)`: the two questions those checks ask of the file system.

Here, not in preprocess/, because every command (train.py, plan.py, translate.py, the checkpoint tools) asks them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from common.errors import fail

PathLike = str | os.PathLike


def read_json(path: PathLike, what: str):
    """A JSON file the user points at (recipe, rank table, DeepSpeed config): a missing file, a folder, a syntax
    error, bytes that are not UTF-8 and a key given twice in one object (JSON would silently keep the last) are each
    a one-line UserError naming `what` and the path."""
    import json

    if os.path.isdir(path):
        fail(f"{what} {path} is a folder; give the JSON file")
    if not os.path.isfile(path):
        fail(f"{what} {path} not found")

    def no_duplicates(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                fail(
                    f"{what} {path}: the key {json.dumps(key)} appears twice in one object; JSON keeps only the "
                    f"last one, so delete the one you did not mean"
                )
            seen.add(key)
        return dict(pairs)

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        fail(f"{what} {path} is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}")
    except UnicodeDecodeError as exc:
        fail(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})")


def nearest_existing(path: PathLike) -> Path:
    """`path` made absolute, or the nearest folder above it that exists (where creating it would start)."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    return existing


def check_output_file(path: PathLike, what: str) -> Path:
    """Before any work: `path` can become a file — it is not a folder, and no folder above it is a file. Returns it
    as a Path (its folder is created by the writer)."""
    path = Path(path)
    if path.is_dir():
        fail(f"{what} {path} is a folder; give a file name (e.g. {path / 'out'})")
    parent = nearest_existing(path.absolute().parent)
    if not parent.is_dir():
        fail(f"{what} {path} cannot be written: {parent} is a file, not a folder")
    return path


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether `a` and `b` are one file on disk: the same path spelled otherwise (./x, d/../x), a symbolic link to
    it, a hard link (same device and inode). False when either does not exist."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def refuse_output_over_inputs(output: PathLike, what: str, inputs: Iterable[tuple[str, PathLike | None]]) -> None:
    """Before any work: `output` is none of the files the command reads, each given as (how to name it to the user,
    e.g. "--src a.txt"; its path, None when not given). A command writes its output once the work is done
    (atomic_write), so an output that is an input would silently replace it (evaluate.py --src F --output F left
    the hypotheses in F, exit 0)."""
    for label, path in inputs:
        if path is not None and same_file(output, path):
            other = str(path) in label and os.path.abspath(output) != os.path.abspath(path)
            fail(
                f"{what} {output} is {label}{' (the same file under another name)' if other else ''}: writing "
                f"there would replace what the command reads; give another output file"
            )
