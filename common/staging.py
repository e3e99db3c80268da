"""An output written under a staging name of its own, then renamed into place once complete.

The staging file or folder is created here by tempfile — a unique name beside the output, on its file system, that
no one else can hold — and removed after a failure of the writer that created it. Never a fixed name such as
`OUT.tmp` or `OUT.part`: that name may be a user's, and a converter that emptied `NEW.tmp` before writing removed a
user's folder of that name (or renamed it into NEW, its files gone).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from common.errors import UserError
from common.file_modes import as_created


@contextlib.contextmanager
def staged_file(path: str, suffix: str = "") -> Iterator[str]:
    """A new empty file beside `path` to write the output into (`suffix`: for writers that read the format from the
    name, e.g. ".png"). On success it replaces `path`, with the mode a plain open() gives (mkstemp's is 0600); on
    any failure, Ctrl-C included, it is removed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=f".part{suffix}")
    os.close(fd)
    try:
        yield tmp
        as_created(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


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
def staged_folder(path: str) -> Iterator[str]:
    """A new empty folder beside `path` (which must not exist) to write the output into. On success it is renamed
    to `path`, with the modes plain mkdir()/open() give (mkdtemp's is 0700); on any failure it is removed with
    everything in it, and so are the folders above `path` this call created (if still empty)."""
    parent = os.path.dirname(os.path.abspath(path))
    created = _missing_folders(parent)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(path))}.", suffix=".part")
    try:
        yield tmp
        as_created(tmp)
        if os.path.lexists(path):        # made meanwhile: rename() would replace an empty folder without a word
            raise UserError(f"{path} appeared while the output was being written; nothing was written over it — "
                            f"name a new folder")
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
