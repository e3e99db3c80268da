"""A TSV's sha256 (its identity: it names the token store and an auto-built tokenizer), hashed once per change.

The digest is kept in a small file in the cache folder (where the store goes: --cache_dir, else <TSV dir>/.tokcache),
keyed on the TSV's real path, size, modification time and inode; it is reused only while all four are what they
were, the time is older than the record's own (a change within the same clock tick may keep the time), and a sample
of the file's bytes (common.hashing.sample_sha256, 1 MiB) is the recorded one — another file copied over it with
its time kept (`cp` + `touch -r`) is hashed again at once. An edit between the sampled places keeps the sample: a
digest taken from the record is therefore `trust`ed (preprocess.trusted_files), and train.py hashes the file in full
once per job beside its first steps. A folder that cannot be written keeps no record: the TSV is hashed at each
start, as before. See docs/data.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from common.hashing import file_sha256, sample_sha256
from common.staging import atomic_write
from preprocess.trusted_files import trust

RECORDS = "tsv-sha256"  # the records' folder inside the cache folder


def _stat(path: Path) -> dict:
    st = os.stat(path)
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def record_path(tsv: Path, cache_root: Path) -> Path:
    """One record per TSV (two TSVs with one name in different folders may share a --cache_dir)."""
    key = hashlib.sha256(str(tsv).encode()).hexdigest()[:16]
    return cache_root / RECORDS / f"{tsv.name}-{key}.json"


def _recorded(record: Path, now: dict, tsv: Path):
    """The recorded sha256 while the file is the one recorded: its stat, a time older than the record, its sample (a
    record without one, from before samples were kept, is not trusted: the file is hashed once more)."""
    try:
        when = record.stat().st_mtime_ns
        with open(record, encoding="utf-8") as f:
            saved = json.load(f)
        if (
            saved["file"] == now
            and now["mtime_ns"] < when
            and isinstance(saved["sha256"], str)
            and saved["sample"] == sample_sha256(tsv)
        ):
            return saved["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _changed(tsv: Path, record: Path, recorded: dict, found: str) -> str:
    """The full check found other bytes than the record's sha256 (preprocess.trusted_files): record the sha256 found
    while the file is still as it was read, so the next start names a new store (else drop the record: it hashes
    again); the line that stops the run."""
    if _stat(tsv) == recorded:
        _record(record, recorded, found, sample_sha256(tsv))
    else:
        with contextlib.suppress(OSError):
            record.unlink()
    return (
        f"{tsv} has changed since its sha256 was recorded ({record}): its size and modification time are the "
        f"recorded ones but its bytes are not (an edit that kept them: cp + touch -r, rsync -t, os.utime), so "
        f"this run opened the token store of the file as it was. Run the same command again: the record now "
        f"follows the file, and the next start builds a new token store from it"
    )


def _record(record: Path, now: dict, digest: str, sample: str) -> None:
    # a read-only cache folder: no record, the next start hashes again
    with contextlib.suppress(OSError), atomic_write(record) as f:
        json.dump({"file": now, "sha256": digest, "sample": sample}, f, indent=1)


def tsv_sha256(tsv_path, cache_root) -> tuple[str, dict]:
    """(the TSV's sha256, its stat as keyed) — from the record when the file is unchanged (then trusted: hashed in
    full once per job by train.py), else hashed and recorded."""
    tsv = Path(os.path.realpath(tsv_path))
    now = _stat(tsv)
    record = record_path(tsv, Path(cache_root))
    digest = _recorded(record, now, tsv)
    if digest is not None:
        trust(tsv, digest, lambda found: _changed(tsv, record, now, found))
        return digest, now
    sample = sample_sha256(tsv)
    digest = file_sha256(tsv)
    if _stat(tsv) == now:  # not changed while it was read: the digest (and sample) are the file's
        _record(record, now, digest, sample)
    return digest, now
