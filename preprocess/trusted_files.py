"""The files a start took on trust, to be hashed in full once per job.

Hashing a 40 GB corpus at every start is about a minute of CPU, so a start takes a file's recorded sha256 — the
corpus's record (preprocess.tsv_digest), a token store's verdict (verified.json, preprocess.token_store) — when the
file's size, modification time and a sample of its bytes (common.hashing.sample_sha256: 1 MiB at fixed places) are
the recorded ones. That catches another file copied over with its time kept, not an edit between the sampled places:
so each file taken that way is `trust`ed here, and train.py hashes them all in full on a thread beside its first
steps (training.core.data_recheck). A file that no longer matches stops the run in one line; its `mismatch` first
makes the next start see the change (a new record, or no verdict), so that start rebuilds what the file feeds.

A process that never runs the check (python -m preprocess.dataset) leaves its list unread: it only opens a store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.hashing import file_sha256


@dataclass(frozen=True)
class Trusted:
    path: Path
    sha256: str  # what the file must still hash to
    mismatch: Callable[[str], str]  # given the sha256 found: forgets what trusted the file, returns the line


_trusted: dict[Path, Trusted] = {}  # by path: a file trusted twice (train and valid sets alike) is hashed once


def trust(path: Path, sha256: str, mismatch: Callable[[str], str]) -> None:
    """Note a file whose recorded sha256 this process used without hashing the file."""
    _trusted[Path(path)] = Trusted(Path(path), sha256, mismatch)


def take() -> list[Trusted]:
    """The files trusted so far (and none left noted): what this process's full check hashes."""
    files = list(_trusted.values())
    _trusted.clear()
    return files


def first_mismatch(files: list[Trusted]) -> str | None:
    """Hash each file in full; the line for the first one that is not what was trusted (after its `mismatch` has
    run), None when all match."""
    for entry in files:
        try:
            found = file_sha256(entry.path)
        except OSError as exc:
            return (
                f"{entry.path} cannot be read any more ({exc.strerror or exc}) — it was there when this run "
                f"started; put it back, or start again with the data as it is now"
            )
        if found != entry.sha256:
            return entry.mismatch(found)
    return None
