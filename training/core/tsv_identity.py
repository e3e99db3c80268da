"""The training TSV's sha256 on every rank, read from disk by one: rank 0 takes it (preprocess.tsv_digest: its
record, or a hash when the file changed) and one broadcast hands it to the others — instead of every rank hashing
the whole corpus at every start (a 40 GB corpus is about a minute of CPU per rank)."""
from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from common.errors import UserError
from common.hashing import file_sha256
from preprocess.corpus_source import CorpusSource
from preprocess.dataset import default_cache_root
from preprocess.tsv_digest import tsv_sha256


def _cache_root(file_path: str, cache_dir: str | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_root(Path(os.path.abspath(file_path)))


def shared_tsv_sha256(file_path: str, cache_dir: str | None, source: CorpusSource | None = None) -> str:
    """Collective when a process group of several ranks exists: every rank calls it at the same point. `source`: a
    table (not a TSV), whose identity (preprocess.corpus_source) rank 0 takes and hands on as it is."""
    root = _cache_root(file_path, cache_dir)
    table = source is not None and not source.is_tsv
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return source.identity(root) if table else tsv_sha256(file_path, root)[0]
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (source.identity(root), None) if table else tsv_sha256(file_path, root)
        except OSError as exc:                       # every rank stops with rank 0's line, none waits
            box[0] = f"{file_path} cannot be read on rank 0 ({exc.strerror or exc})"
        except UserError as exc:                     # a wrong split or column: the same line on every rank
            box[0] = str(exc)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise UserError(box[0])
    if table:
        return box[0][0]
    digest, seen = box[0]
    mine = os.stat(file_path)
    if (mine.st_size, mine.st_mtime_ns) != (seen["size"], seen["mtime_ns"]):
        return file_sha256(file_path)                # another file at this path here (a node's own copy): its own
    return digest
