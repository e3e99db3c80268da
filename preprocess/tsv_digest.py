"""A TSV's sha256 (its identity: it names the token store and an auto-built tokenizer), hashed once per change.

The digest is kept in a small file in the cache folder (where the store goes: --cache_dir, else <TSV dir>/.tokcache),
keyed on the TSV's real path, size, modification time and inode; it is reused only while all four are what they
were, and the time is older than the record's own (a change within the same clock tick may keep the time). A folder
that cannot be written keeps no record: the TSV is hashed at each start, as before. See docs/data.md.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from pathlib import Path

from common.hashing import file_sha256

RECORDS = "tsv-sha256"                     # the records' folder inside the cache folder


def _stat(path: Path) -> dict:
    st = os.stat(path)
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def record_path(tsv: Path, cache_root: Path) -> Path:
    """One record per TSV (two TSVs with one name in different folders may share a --cache_dir)."""
    key = hashlib.sha256(str(tsv).encode()).hexdigest()[:16]
    return cache_root / RECORDS / f"{tsv.name}-{key}.json"


def _recorded(record: Path, now: dict):
    try:
        when = record.stat().st_mtime_ns
        with open(record, encoding="utf-8") as f:
            saved = json.load(f)
        if saved["file"] == now and now["mtime_ns"] < when and isinstance(saved["sha256"], str):
            return saved["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _record(record: Path, now: dict, digest: str) -> None:
    tmp = record.parent / f".{record.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"file": now, "sha256": digest}, f, indent=1)
        os.replace(tmp, record)
    except OSError:                          # a read-only cache folder: no record, the next start hashes again
        with contextlib.suppress(OSError):
            tmp.unlink()


def tsv_sha256(tsv_path, cache_root) -> tuple[str, dict]:
    """(the TSV's sha256, its stat as keyed) — from the record when the file is unchanged, else hashed and recorded."""
    tsv = Path(os.path.realpath(tsv_path))
    now = _stat(tsv)
    record = record_path(tsv, Path(cache_root))
    digest = _recorded(record, now)
    if digest is None:
        digest = file_sha256(tsv)
        if _stat(tsv) == now:                # not changed while it was read: the digest is the file's
            _record(record, now, digest)
    return digest, now
