"""An output written under a staging name of its own, then renamed into place once complete: the one way this
repository writes a file that someone may read (readers see the old file, or none, or the complete new one).

- `atomic_write(path, mode)`: an open file to write, fsynced and renamed into place when the block ends.
- `staged_file(path)`: a staging file's name, for writers that take a path (torch.save, safetensors, matplotlib).
- `staged_folder(path)`: the same for a folder of files (a converted checkpoint, an exported model).

The staging file or folder is created here by tempfile — a unique name beside the output, on its file system, that
no one else can hold — and removed after a failure of the writer that created it. Never a fixed name such as
`OUT.tmp` or `OUT.part` in a folder the user chose: that name may be a user's, and a converter that emptied
`NEW.tmp` before writing removed a user's folder of that name (or renamed it into NEW, its files gone). Only the
checkpoint files, in the run's own checkpoints/ folder, pass a fixed `staging` name: the disk-full guard removes it
and the next start clears what a crash left (training.checkpoint.folder).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

from common.errors import UserError
from common.file_modes import as_created


@contextlib.contextmanager
def staged_file(path: str | os.PathLike, suffix: str = "", staging: str | None = None) -> Iterator[str]:
    """A new empty file beside `path` to write the output into (`suffix`: for writers that read the format from the
    name, e.g. ".png"; `staging`: a fixed name the caller owns instead, see the module docstring). Missing folders
    above `path` are created. On success it replaces `path`, with the mode a plain open() gives (mkstemp's is 0600);
    on any failure, Ctrl-C included, it is removed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    if staging is None:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=f".part{suffix}")
        os.close(fd)
    else:
        tmp = staging
    try:
        yield tmp
        as_created(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", staging: str | None = None) -> Iterator[IO]:
    """An open file ("w": UTF-8 text with "\n" line ends; "wb": bytes) whose content replaces `path` when the block
    ends without an exception, through `staged_file` (its names, folders, modes and cleanup). The bytes are
    fsynced before the rename: without that, a crash of the machine soon after can leave the new name on an empty
    file, which is the very state an atomic write is there to prevent."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode {mode!r}; use 'w' (text) or 'wb' (bytes)")
    text = {"encoding": "utf-8", "newline": "\n"} if mode == "w" else {}
    with staged_file(path, staging=staging) as tmp, open(tmp, mode, **text) as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())


def _missing_folders(folder: str) -> list[str]:
    """`folder` and the folders above it that do not exist yet, deepest first."""
    missing = []
    while not os.path.exists(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return missing


@contextlib.contextmanager
def staged_folder(path: str, replace: bool = False) -> Iterator[str]:
    """A new empty folder beside `path` (which must not exist) to write the output into. On success it is renamed
    to `path`, with the modes plain mkdir()/open() give (mkdtemp's is 0700); on any failure it is removed with
    everything in it, and so are the folders above `path` this call created (if still empty). `replace`: the
    caller has checked the folder now at `path` and decided it may go (export_hf.py --overwrite); it is removed
    only once the new one is complete."""
    parent = os.path.dirname(os.path.abspath(path))
    created = _missing_folders(parent)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(path))}.", suffix=".part")
    try:
        yield tmp
        as_created(tmp)
        if replace and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        if os.path.lexists(path):  # made meanwhile: rename() would replace an empty folder without a word
            raise UserError(
                f"{path} appeared while the output was being written; nothing was written over it — name a new folder"
            )
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
