"""sha256 of a file, read in chunks: the one way this repository fingerprints data, tokenizers and checkpoints."""
from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file's bytes (memory stays flat however large the file is)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()
