"""sha256 of a file, read in chunks: the one way this repository fingerprints data, tokenizers and checkpoints; and
the sha256 of a sample of a file's bytes, which tells cheaply, at every start, that a large file is still the one
whose full sha256 was recorded (docs/data.md, "The TSV's identity")."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHUNK = 1 << 20
SAMPLE_BLOCK = 16 << 10  # bytes read at each sampled place
SAMPLE_BLOCKS = 64  # places, evenly spaced from the first block to the last: 1 MiB read in all


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file's bytes (memory stays flat however large the file is)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sample_offsets(size: int) -> list[int]:
    """Where sample_sha256 reads its SAMPLE_BLOCK-byte blocks in a file of `size` bytes: fixed places, evenly
    spaced, the head and the tail among them ([0] for a file it reads whole)."""
    if size <= SAMPLE_BLOCK * SAMPLE_BLOCKS:
        return [0]
    last = size - SAMPLE_BLOCK
    return [last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]


def sample_sha256(path: str | Path) -> str:
    """The hex sha256 of a file's size and of SAMPLE_BLOCKS blocks at `sample_offsets` (1 MiB, whatever the file's
    size; a file no larger is read whole). Another file copied over a recorded one with its size and time kept
    (`cp` + `touch -r`) differs here; an edit between the sampled places does not, which is why a start that trusts a
    recorded sha256 on this evidence has the file hashed in full once per job (preprocess.trusted_files)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.sha256(f"{size}:".encode())
        offsets = sample_offsets(size)
        if offsets == [0]:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                digest.update(chunk)
        else:
            for offset in offsets:
                digest.update(os.pread(f.fileno(), SAMPLE_BLOCK, offset))
    return digest.hexdigest()
