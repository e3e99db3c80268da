"""The training TSV's sha256 on every rank, read from disk by one: rank 0 takes it (preprocess.tsv_digest: its
record, or a hash when the file changed) and the job's store hands it to the others, which poll for it outside any
collective (training.core.data_wait) — instead of every rank hashing the whole corpus at every start (a 40 GB corpus
is about a minute of CPU per rank). A rank that sees another file at the path (another size, time or sample of its
bytes: a node with its own copy) hashes its own."""

from __future__ import annotations

import os
from pathlib import Path

from common.errors import UserError
from common.hashing import file_sha256, sample_sha256
from common.ranks import local_rank_from_env
from preprocess.corpus_source import CorpusSource
from preprocess.dataset import default_cache_root
from preprocess.tsv_digest import tsv_sha256
from training.core.data_wait import DataWait


def _cache_root(file_path: str, cache_dir: str | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_root(Path(os.path.abspath(file_path)))


def shared_tsv_sha256(file_path: str, cache_dir: str | None, source: CorpusSource | None = None) -> str:
    """Every rank of a job of several calls it at the same point. `source`: a table (not a TSV), whose identity
    (preprocess.corpus_source) rank 0 takes and hands on as it is."""
    root = _cache_root(file_path, cache_dir)
    table = source is not None and not source.is_tsv
    wait = DataWait.for_job(local_rank_from_env())
    if wait is None:
        return source.identity(root) if table else tsv_sha256(file_path, root)[0]

    def on_rank_0():
        try:
            return [source.identity(root), None] if table else [*tsv_sha256(file_path, root), sample_sha256(file_path)]
        except OSError as exc:  # every rank stops with rank 0's line, none waits
            return f"{file_path} cannot be read on rank 0 ({exc.strerror or exc})"
        except UserError as exc:  # a wrong split or column: the same line on every rank
            return str(exc)

    box = wait.from_rank_0(on_rank_0)
    if isinstance(box, str):
        raise UserError(box)
    if table:
        return box[0]
    digest, seen, sample = box
    mine = os.stat(file_path)
    if (mine.st_size, mine.st_mtime_ns) != (seen["size"], seen["mtime_ns"]) or sample_sha256(file_path) != sample:
        return file_sha256(file_path)  # another file at this path here (a node's own copy): its own
    return digest
