"""The token store: a corpus's token ids on disk, compact and memory-mapped (the one home of its format).

A store is one folder:

    meta.json         format version, pairs, token dtype, the lengths it was cut to, statistics (written last)
    src.tokens        the sources' ids back to back, each cut to its first src_len-1 tokens (uint16 or uint32)
    tgt.tokens        the targets' ids y back to back, each cut to its first tgt_len-1 tokens
    src.offsets       int64 [pairs + 1]: source i is src.tokens[offsets[i]:offsets[i + 1]]
    tgt.offsets       int64 [pairs + 1]
    truncated.flags   uint8 [pairs]: bit 0 = the source was cut, bit 1 = the target was cut

Ids take the smallest width the vocabulary allows: uint16 below 65,536 ids, else uint32. No BOS, EOS or padding is
stored; `padded_rows` adds them when a batch is built, so a batch is exactly what the fixed-width arrays held before
(format 1): source tokens[:src_len-1] + [EOS]; decoder input [BOS] + y; labels y + [EOS]; then PAD.

Loading maps the files read-only (`np.memmap`): a rank's resident memory does not grow with the corpus, and the
ranks of a node share one copy of the pages in the page cache. numpy's memmap was chosen over Arrow (measured in
BENCHMARKS.md, "Token store format"): the same bytes on disk, and building a padded batch is one fancy index instead
of a take + flatten + copy through Arrow; it also keeps `datasets`/pyarrow out of every rank's start-up.

`StoreWriter` writes a store chunk by chunk into a hidden `.tmp-*` folder beside its final name, checks the free
space as it goes (a store that will not fit stops after its first chunks, naming what it needs), and renames the
folder into place only when complete: a killed run, a full disk or a bad line leaves nothing under a valid name.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from common.errors import NO_ROOM, UserError, fail
from common.units import human_bytes

FORMAT_VERSION = 2                      # 1 was three padded int64 Arrow columns (datasets.save_to_disk)
META_FILE = "meta.json"
SIDES = ("src", "tgt")
FLAGS_FILE = "truncated.flags"
UINT16_IDS = 1 << 16


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits 16 bits, else uint32 (twice the bytes)."""
    return np.dtype(np.uint16) if vocab_size <= UINT16_IDS else np.dtype(np.uint32)


def tokens_file(side: str) -> str:
    return f"{side}.tokens"


def offsets_file(side: str) -> str:
    return f"{side}.offsets"


@dataclass
class TokenChunk:
    """One chunk of consecutive pairs, tokenized and cut: what a worker sends back to the writer."""
    src_ids: np.ndarray                 # token dtype, the kept source tokens back to back
    src_lengths: np.ndarray             # int64 [pairs]: kept source tokens per pair
    tgt_ids: np.ndarray
    tgt_lengths: np.ndarray
    flags: np.ndarray                   # uint8 [pairs]
    stats: dict = field(default_factory=dict)   # counts summed over chunks (STAT_COUNTS)

    @property
    def pairs(self) -> int:
        return len(self.flags)

    @property
    def nbytes(self) -> int:
        return (self.src_ids.nbytes + self.tgt_ids.nbytes + 8 * (len(self.src_lengths) + len(self.tgt_lengths))
                + self.flags.nbytes)


# counts every chunk reports, summed into meta.json's "counts" (stats() turns them into the printed figures)
STAT_COUNTS = ("src_tokens_before_cut", "tgt_tokens_before_cut", "src_truncated", "tgt_truncated", "unk")


def cannot_write(folder: Path, exc: OSError) -> UserError:
    return UserError(f"cannot write the token store under {folder} ({exc.strerror or exc}); pass --cache_dir DIR, "
                     f"a folder this process can write (the data folder may stay read-only)")


class StoreWriter:
    """Write a store into `<final>.tmp-*`, chunk by chunk; `commit` renames it to `final`. Use as a context manager:
    any exception (a bad line, a full disk, Ctrl-C) removes the temporary folder."""

    def __init__(self, final: Path, dtype: np.dtype, source_name: str):
        self.final, self.dtype, self.source_name = Path(final), np.dtype(dtype), source_name
        self.tmp = self.final.parent / f".tmp-{self.final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.tmp.mkdir(parents=True)
        except OSError as exc:
            raise cannot_write(self.final.parent, exc) from None
        self.files = {}
        try:
            for side in SIDES:
                self.files[tokens_file(side)] = open(self.tmp / tokens_file(side), "wb")
                self.files[offsets_file(side)] = open(self.tmp / offsets_file(side), "wb")
            self.files[FLAGS_FILE] = open(self.tmp / FLAGS_FILE, "wb")
        except OSError as exc:
            self.abort()
            raise cannot_write(self.final.parent, exc) from None
        self.position = {side: 0 for side in SIDES}   # tokens written per side
        self.pairs, self.written = 0, 0
        self.counts = {name: 0 for name in STAT_COUNTS}
        for side in SIDES:
            self._write(offsets_file(side), np.zeros(1, dtype=np.int64))

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.abort()

    def _free(self) -> Optional[int]:
        """Free bytes on the store's disk (None when the system will not say)."""
        try:
            return shutil.disk_usage(self.final.parent).free
        except OSError:
            return None

    def _write(self, name: str, array: np.ndarray) -> None:
        try:
            self.files[name].write(memoryview(np.ascontiguousarray(array)).cast("B"))
        except OSError as exc:
            if exc.errno in NO_ROOM:
                self._no_room(exc)
            raise
        self.written += array.nbytes

    def _no_room(self, exc: OSError) -> None:
        self.abort()
        raise UserError(f"{NO_ROOM[exc.errno]} writing the token store for {self.source_name} in "
                        f"{self.final.parent} ({human_bytes(self._free() or 0, base=1000)} free there, "
                        f"{human_bytes(self.written, base=1000)} written); free space or pass --cache_dir DIR on a larger "
                        f"disk") from None

    def append(self, chunk: TokenChunk, fraction_read: float) -> None:
        """Write one chunk. `fraction_read`: how much of the input has been read so far (0..1): with the bytes
        written it projects the store's size, and a store that cannot fit stops now rather than at a full disk."""
        free = self._free()                   # None: no figure to check against; the writes themselves will tell
        expected_more = chunk.nbytes
        if fraction_read > 0:
            projected = (self.written + chunk.nbytes) / fraction_read
            expected_more = max(expected_more, projected - self.written)
        if free is not None and expected_more > free:
            self.abort()
            fail(f"the token store for {self.source_name} needs about {human_bytes(self.written + expected_more, base=1000)} "
                 f"but {self.final.parent} has {human_bytes(free, base=1000)} free; free space there or pass --cache_dir DIR "
                 f"on a larger disk")
        for side, ids, lengths in (("src", chunk.src_ids, chunk.src_lengths), ("tgt", chunk.tgt_ids,
                                                                               chunk.tgt_lengths)):
            self._write(tokens_file(side), ids.astype(self.dtype, copy=False))
            self._write(offsets_file(side), self.position[side] + np.cumsum(lengths, dtype=np.int64))
            self.position[side] += int(ids.size)
        self._write(FLAGS_FILE, chunk.flags)
        self.pairs += chunk.pairs
        for name in STAT_COUNTS:
            self.counts[name] += int(chunk.stats.get(name, 0))

    def commit(self, meta: dict) -> None:
        """Finish the files, write meta.json, and rename the folder into place (another process that built the
        same store first wins; ours is then dropped)."""
        try:
            for handle in self.files.values():
                handle.flush()
                os.fsync(handle.fileno())     # the data is on disk before the name says it is complete
                handle.close()
            full = {"format": FORMAT_VERSION, "pairs": self.pairs, "token_dtype": self.dtype.name,
                    "tokens": dict(self.position), "counts": self.counts, **meta}
            with open(self.tmp / META_FILE, "w", encoding="utf-8") as f:
                json.dump(full, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if exc.errno in NO_ROOM:
                self._no_room(exc)
            raise
        try:
            os.rename(self.tmp, self.final)
        except OSError:
            if not (self.final / META_FILE).is_file():
                raise
            self.abort()                       # an identical store finished first (another rank or node)

    def abort(self) -> None:
        for handle in self.files.values():
            with contextlib.suppress(OSError):
                handle.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class TokenStore:
    """A store opened read-only: memory-mapped ids and offsets, and the figures of its meta.json."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        try:
            with open(self.folder / META_FILE, encoding="utf-8") as f:
                self.meta = json.load(f)
            if self.meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {self.meta.get('format')}, this code reads {FORMAT_VERSION}")
            self.pairs = int(self.meta["pairs"])
            self.dtype = np.dtype(self.meta["token_dtype"])
            self.tokens, self.offsets = {}, {}
            for side in SIDES:
                count = int(self.meta["tokens"][side])
                self.tokens[side] = _map(self.folder / tokens_file(side), self.dtype, count)
                self.offsets[side] = _map(self.folder / offsets_file(side), np.dtype(np.int64), self.pairs + 1)
                if self.offsets[side][0] != 0 or self.offsets[side][-1] != count:
                    raise ValueError(f"{offsets_file(side)} does not end at the {count} tokens of {tokens_file(side)}")
            self.flags = _map(self.folder / FLAGS_FILE, np.dtype(np.uint8), self.pairs)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            fail(f"{self.folder}: unreadable tokenization cache ({exc}); delete the folder to rebuild it")

    def lengths(self, side: str, idx: Optional[np.ndarray] = None) -> np.ndarray:
        """Stored (kept) tokens per pair, int64: all pairs, or those of `idx`."""
        off = self.offsets[side]
        if idx is None:
            return np.diff(off)
        return off[idx + 1] - off[idx]

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file())

    def padded_rows(self, side: str, idx: np.ndarray, width: int, pad: int, lead: Optional[int] = None,
                    end: Optional[int] = None) -> np.ndarray:
        """int64 [len(idx), width]: each pair's ids, after `lead` (BOS) if given and followed by `end` (EOS) if
        given, then `pad`; positions past `width` are cut."""
        off, tokens = self.offsets[side], self.tokens[side]
        starts = off[idx]
        lengths = off[idx + 1] - starts
        shift = 0 if lead is None else 1
        out = np.full((len(idx), width), pad, dtype=np.int64)
        if lead is not None and width > 0:
            out[:, 0] = lead
        cols = np.arange(max(width - shift, 0))
        rows, where = np.nonzero(cols[None, :] < lengths[:, None])
        out[rows, where + shift] = tokens[starts[rows] + where]
        if end is not None:
            fits = lengths + shift < width
            out[np.flatnonzero(fits), lengths[fits] + shift] = end
        return out


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """`count` items of `dtype` in `path`, mapped read-only; a file of another size is damage, not data."""
    size = path.stat().st_size
    if size != count * dtype.itemsize:
        raise ValueError(f"{path.name} holds {size} bytes, {count * dtype.itemsize} expected")
    if count == 0:
        return np.zeros(0, dtype=dtype)       # mmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
