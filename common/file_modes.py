"""Give files the mode a plain open()/mkdir() would: some writers make them private (safetensors' save_file
writes 0600 files; tempfile.mkdtemp makes 0700 folders), which a model folder or a consolidated state dict that
others read must not keep."""

from __future__ import annotations

import os


def umask() -> int:
    """The process's umask, read without changing it where Linux reports it (os.umask alone must set one to
    read it, which a thread creating a file at that moment would see)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_created(path: str) -> None:
    """`path` (a file, or a folder and everything under it) gets 0666 / 0777 less the umask, executable bits of
    files kept."""
    mask = umask()
    paths = [path]
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            paths += [os.path.join(root, n) for n in dirs + files]
    for p in paths:
        if os.path.islink(p):
            continue
        if os.path.isdir(p):
            os.chmod(p, 0o777 & ~mask)
        else:
            executable = os.stat(p).st_mode & 0o111
            os.chmod(p, (0o666 | (0o111 if executable else 0)) & ~mask)
