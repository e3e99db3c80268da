"""A checkpoint save that runs out of room ends with one line saying so and where, and leaves no partial save.

Every checkpoint file is written through `checkpoint_file_guard(part_path)` (training.checkpoint.manager: _write_atomic,
the shard and RNG writers in save; a new writer must keep doing so). When a write fails because the disk is full
(ENOSPC), a quota is exceeded (EDQUOT) or a file-size limit is hit (EFBIG: `ulimit -f`), the `.part` file is
removed and, on global rank 0, the whole `step_N.tmp/` folder of the interrupted save; the previous checkpoint and
`latest` are untouched (they are only replaced after a complete save). Another rank leaves the folder to rank 0,
which may still be writing there; what remains is removed when a run next starts in OUTPUT_DIR
(training.run.output_lock.remove_partial_saves). The error is recognised however the writer reports it: torch's zip
writer raises `RuntimeError: ... unexpected pos` with the OSError as its context, safetensors a message naming the
OS error.

A rank whose save folder was removed under it (rank 0 gave up first) stops with a line saying so; the launcher
normally ends it before that line is printed (common.errors: other ranks report a moment later).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator

from common.errors import UserError, no_room_error
from common.ranks import global_rank
from training.checkpoint.latest_pointer import read_name

# how writers that do not keep the OSError (safetensors' Rust IO) name the same errors
NO_ROOM_TEXT = {
    "No space left on device": errno.ENOSPC,
    "os error 28": errno.ENOSPC,
    "StorageFull": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "os error 122": errno.EDQUOT,
    "File too large": errno.EFBIG,
    "os error 27": errno.EFBIG,
    "FileTooLarge": errno.EFBIG,
}


def out_of_room(exc: BaseException) -> int | None:
    """ENOSPC / EDQUOT / EFBIG when `exc` (or what caused it) is a write that ran out of room, else None."""
    found = no_room_error(exc)
    if found is not None:
        return found.errno
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for text, code in NO_ROOM_TEXT.items():
            if text in str(e):
                return code
        e = e.__cause__ or e.__context__
    return None


def _free(path: str) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1024
    return "unknown"


def _latest(root: str) -> str:
    try:
        name = read_name(root)
    except OSError:
        name = None
    return f"{name} is still the latest checkpoint" if name else "no earlier checkpoint was affected"


@contextlib.contextmanager
def checkpoint_file_guard(part_path: str) -> Iterator[None]:
    """Around the writing of one checkpoint file to `part_path` (renamed into place by the caller)."""
    try:
        yield
    except Exception as exc:  # only out-of-room and a vanished save folder are turned into lines
        folder = os.path.dirname(os.path.abspath(part_path))
        in_save = folder.endswith(".tmp")
        save_name = os.path.basename(folder)[: -len(".tmp")]
        root = os.path.dirname(folder) if in_save else folder
        free = _free(root)  # before the cleanup gives some back
        with contextlib.suppress(OSError):
            os.remove(part_path)
        code = out_of_room(exc)
        if code is None:
            if in_save and not os.path.isdir(folder):
                raise UserError(
                    f"saving checkpoint {save_name} into {root} was abandoned by another rank (its "
                    f"line says why; {free} free there)"
                ) from None
            raise
        removed = "The partial save was removed"
        if in_save and global_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
        elif in_save:  # rank 0 may still write there; the next start cleans up
            removed = "This rank's partial file was removed (the rest goes when a run next starts here)"
        saving = f"saving checkpoint {save_name}" if in_save else f"writing {os.path.basename(part_path)[:-5]}"
        what, why, fix = {
            errno.ENOSPC: (
                "the disk is full",
                f"no space left on the device, {free} free there",
                "Free space, lower --keep_checkpoint_max, or choose an --output_dir on a disk with room",
            ),
            errno.EDQUOT: (
                "the disk quota is exceeded",
                f"{free} free on the disk",
                "Free space in your quota, lower --keep_checkpoint_max, or choose another --output_dir",
            ),
            errno.EFBIG: (
                "a file-size limit was reached",
                "a file grew past `ulimit -f` or the filesystem's largest file",
                "Raise the limit (ulimit -f unlimited) or choose an --output_dir on another filesystem",
            ),
        }[code]
        raise UserError(f"{what}: {saving} into {root} failed ({why}). {removed} and {_latest(root)}. {fix}") from None
