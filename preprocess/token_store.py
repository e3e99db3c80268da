"""The token store: a corpus's token ids on disk, compact and memory-mapped (the one home of its format).

A store is one folder:

    meta.json         format version, pairs, token dtype, the lengths it was cut to, statistics, the sha256 of
                      every other file (written last)
    src.tokens        the sources' ids back to back, each cut to its first src_len-1 tokens (uint16 or uint32)
    tgt.tokens        the targets' ids y back to back, each cut to its first tgt_len-1 tokens
    src.offsets       int64 [pairs + 1]: source i is src.tokens[offsets[i]:offsets[i + 1]]
    tgt.offsets       int64 [pairs + 1]
    truncated.flags   uint8 [pairs]: bit 0 = the source was cut, bit 1 = the target was cut
    verified.json     which files, at which size and modification time, matched their sha256 (the verdict kept,
                      so an unchanged store is not hashed again)

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
It hashes each file as it writes it (no second read) and records the sha256s in meta.json, as checkpoints do.

Integrity. A store is checked at two costs. Every open makes the structural checks (numpy over the maps: each
file's size, offsets that start at 0, never decrease and end at the token count, ids below the vocabulary) — what
keeps a damaged store from being trained on as garbled pairs or failing hundreds of steps later; 0.05 s for 4.5 M
pairs (docs/data.md). An open with `verify` (one process per node: the one that would build the store)
also compares each file's sha256 with the one its writer recorded, unless verified.json already holds that file at
its current size, modification time and sample of its bytes (common.hashing.sample_sha256, 1 MiB; the verdict of an
earlier check, or of the writer); it then records its own verdict, so later opens of an unchanged store hash
nothing. A timestamp no later than the verdict's own is not trusted (a change within the file system's clock tick
would keep it), as git treats "racily clean" files. A file the verdict vouches for is `trust`ed
(preprocess.trusted_files): train.py hashes it in full once per job beside its first steps, which finds ids changed
between the sampled places with the size and time kept. A damaged file raises `DamagedStore` naming it;
preprocess.dataset.TranslationDataset, which has the TSV, rebuilds the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.errors import NO_ROOM, UserError, fail
from common.hashing import file_sha256, sample_sha256
from common.staging import atomic_write
from common.units import human_bytes
from preprocess.trusted_files import trust

FORMAT_VERSION = 3  # 2 had no checksums; 1 was three padded int64 Arrow columns
META_FILE = "meta.json"
VERIFIED_FILE = "verified.json"
SIDES = ("src", "tgt")
FLAGS_FILE = "truncated.flags"
UINT16_IDS = 1 << 16
CHECK_CHUNK = 1 << 22  # offsets compared this many at a time: bounded temporary memory


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits 16 bits, else uint32 (twice the bytes)."""
    return np.dtype(np.uint16) if vocab_size <= UINT16_IDS else np.dtype(np.uint32)


def tokens_file(side: str) -> str:
    return f"{side}.tokens"


def offsets_file(side: str) -> str:
    return f"{side}.offsets"


DATA_FILES = (tokens_file("src"), offsets_file("src"), tokens_file("tgt"), offsets_file("tgt"), FLAGS_FILE)


class DamagedStore(UserError):
    """A store file that is not what its writer wrote (or no meta.json this code can read): `name` is the file,
    `reason` how it differs. The message says how to rebuild the store; TranslationDataset rebuilds it itself."""

    def __init__(self, folder: Path, name: str, reason: str, source: str | None = None):
        self.folder, self.name, self.reason = Path(folder), name, reason
        tsv = f"its TSV ({source})" if source else "the TSV it was built from"
        super().__init__(
            f"token store {self.folder}: {name} {reason}; delete the folder and run train.py or "
            f"python -m preprocess.dataset with {tsv}, which rebuild it"
        )


@dataclass
class TokenChunk:
    """One chunk of consecutive pairs, tokenized and cut: what a worker sends back to the writer."""

    src_ids: np.ndarray  # token dtype, the kept source tokens back to back
    src_lengths: np.ndarray  # int64 [pairs]: kept source tokens per pair
    tgt_ids: np.ndarray
    tgt_lengths: np.ndarray
    flags: np.ndarray  # uint8 [pairs]
    stats: dict = field(default_factory=dict)  # counts summed over chunks (STAT_COUNTS)

    @property
    def pairs(self) -> int:
        return len(self.flags)

    @property
    def nbytes(self) -> int:
        return (
            self.src_ids.nbytes
            + self.tgt_ids.nbytes
            + 8 * (len(self.src_lengths) + len(self.tgt_lengths))
            + self.flags.nbytes
        )


# counts every chunk reports, summed into meta.json's "counts" (stats() turns them into the printed figures)
STAT_COUNTS = ("src_tokens_before_cut", "tgt_tokens_before_cut", "src_truncated", "tgt_truncated", "unk")


def cannot_write(folder: Path, exc: OSError) -> UserError:
    return UserError(
        f"cannot write the token store under {folder} ({exc.strerror or exc}); pass --cache_dir DIR, "
        f"a folder this process can write (the data folder may stay read-only)"
    )


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
                self.files[tokens_file(side)] = open(self.tmp / tokens_file(side), "wb")  # noqa: SIM115 - the build's
                self.files[offsets_file(side)] = open(self.tmp / offsets_file(side), "wb")  # noqa: SIM115 - as above
            self.files[FLAGS_FILE] = open(self.tmp / FLAGS_FILE, "wb")  # noqa: SIM115 - open until close or abort
        except OSError as exc:
            self.abort()
            raise cannot_write(self.final.parent, exc) from None
        self.digests = {name: hashlib.sha256() for name in self.files}  # of the bytes written, as they go
        self.position = {side: 0 for side in SIDES}  # tokens written per side
        self.pairs, self.written = 0, 0
        self.counts = {name: 0 for name in STAT_COUNTS}
        for side in SIDES:
            self._write(offsets_file(side), np.zeros(1, dtype=np.int64))

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.abort()

    def _free(self) -> int | None:
        """Free bytes on the store's disk (None when the system will not say)."""
        try:
            return shutil.disk_usage(self.final.parent).free
        except OSError:
            return None

    def _write(self, name: str, array: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        try:
            self.files[name].write(data)
        except OSError as exc:
            if exc.errno in NO_ROOM:
                self._no_room(exc)
            raise
        self.digests[name].update(data)
        self.written += array.nbytes

    def _no_room(self, exc: OSError) -> None:
        self.abort()
        raise UserError(
            f"{NO_ROOM[exc.errno]} writing the token store for {self.source_name} in "
            f"{self.final.parent} ({human_bytes(self._free() or 0, base=1000)} free there, "
            f"{human_bytes(self.written, base=1000)} written); free space or pass --cache_dir DIR on a "
            f"larger disk"
        ) from None

    def append(self, chunk: TokenChunk, fraction_read: float) -> None:
        """Write one chunk. `fraction_read`: how much of the input has been read so far (0..1): with the bytes
        written it projects the store's size, and a store that cannot fit stops now rather than at a full disk."""
        free = self._free()  # None: no figure to check against; the writes themselves will tell
        expected_more = chunk.nbytes
        if fraction_read > 0:
            projected = (self.written + chunk.nbytes) / fraction_read
            expected_more = max(expected_more, projected - self.written)
        if free is not None and expected_more > free:
            self.abort()
            need = human_bytes(self.written + expected_more, base=1000)
            fail(
                f"the token store for {self.source_name} needs about {need} but {self.final.parent} has "
                f"{human_bytes(free, base=1000)} free; free space there or pass --cache_dir DIR on a larger disk"
            )
        for side, ids, lengths in (
            ("src", chunk.src_ids, chunk.src_lengths),
            ("tgt", chunk.tgt_ids, chunk.tgt_lengths),
        ):
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
                os.fsync(handle.fileno())  # the data is on disk before the name says it is complete
                handle.close()
            full = {
                "format": FORMAT_VERSION,
                "pairs": self.pairs,
                "token_dtype": self.dtype.name,
                "tokens": dict(self.position),
                "counts": self.counts,
                "sha256": {name: digest.hexdigest() for name, digest in self.digests.items()},
                **meta,
            }
            with open(self.tmp / META_FILE, "w", encoding="utf-8") as f:
                json.dump(full, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if exc.errno in NO_ROOM:
                self._no_room(exc)
            raise
        # the writer's hashes are the first verdict: a store just written is not read back to be hashed again
        record_verified(self.tmp, full["sha256"], _stats(self.tmp), _samples(self.tmp))
        try:
            os.rename(self.tmp, self.final)
        except OSError:
            if not (self.final / META_FILE).is_file():
                raise
            self.abort()  # an identical store finished first (another rank or node)

    def abort(self) -> None:
        for handle in self.files.values():
            with contextlib.suppress(OSError):
                handle.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class TokenStore:
    """A store opened read-only: memory-mapped ids and offsets, and the figures of its meta.json. Every open makes
    the structural checks; `verify` also checks the files' sha256 (see the module docstring)."""

    def __init__(self, folder: Path, verify: bool = True):
        self.folder = Path(folder)
        self.meta: dict = {}  # until it is read: a damaged meta.json names no TSV
        self.meta = self._read_meta()
        self.pairs = int(self.meta["pairs"])
        self.dtype = np.dtype(self.meta["token_dtype"])
        self.tokens, self.offsets = {}, {}
        for side in SIDES:
            self.tokens[side] = self._map(tokens_file(side), self.dtype, int(self.meta["tokens"][side]))
            self.offsets[side] = self._map(offsets_file(side), np.dtype(np.int64), self.pairs + 1)
        self.flags = self._map(FLAGS_FILE, np.dtype(np.uint8), self.pairs)
        for side in SIDES:
            self._check_offsets(side)
            self._check_ids(side)
        self.hashed = self.verify() if verify else []

    def _damaged(self, name: str, reason: str) -> DamagedStore:
        return DamagedStore(self.folder, name, reason, self.meta.get("source"))

    def _read_meta(self) -> dict:
        try:
            with open(self.folder / META_FILE, encoding="utf-8") as f:
                meta = json.load(f)
            if meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"names format {meta.get('format')}, this code reads {FORMAT_VERSION}")
            int(meta["pairs"]), np.dtype(meta["token_dtype"]), int(meta["vocab_size"])
            if sorted(meta["sha256"]) != sorted(DATA_FILES) or any(int(meta["tokens"][s]) < 0 for s in SIDES):
                raise ValueError("does not list every file")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self._damaged(META_FILE, f"cannot be read ({exc})") from None
        return meta

    def _map(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        """`count` items of `dtype` in file `name`, mapped read-only; a file of another size is damage, not data."""
        path = self.folder / name
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise self._damaged(name, f"cannot be read ({exc.strerror or exc})") from None
        if size != count * dtype.itemsize:
            raise self._damaged(name, f"holds {size} bytes, {count * dtype.itemsize} expected")
        if count == 0:
            return np.zeros(0, dtype=dtype)  # mmap cannot map an empty file
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    def _check_offsets(self, side: str) -> None:
        """Pair i is tokens[off[i]:off[i+1]]: offsets from 0 to the token count, never decreasing, so every pair is
        a slice of its side's tokens (a damaged offset would make garbled pairs, or an IndexError steps later)."""
        off, count, name = self.offsets[side], len(self.tokens[side]), offsets_file(side)
        if off[0] != 0 or off[-1] != count:
            raise self._damaged(
                name, f"runs from {off[0]} to {off[-1]}, not from 0 to the {count} tokens of {tokens_file(side)}"
            )
        for start in range(0, self.pairs, CHECK_CHUNK):
            part = off[start : start + CHECK_CHUNK + 1]
            down = np.flatnonzero(part[1:] < part[:-1])
            if down.size:
                pair = start + int(down[0])
                raise self._damaged(name, f"decreases at pair {pair} ({part[down[0]]} then {part[down[0] + 1]})")

    def _check_ids(self, side: str) -> None:
        """Every id is below the vocabulary the store was built with (the embedding tables' rows)."""
        ids, vocab = self.tokens[side], int(self.meta["vocab_size"])
        top = int(ids.max()) if len(ids) else 0
        if top >= vocab:
            where = int(np.argmax(ids >= vocab))
            raise self._damaged(
                tokens_file(side),
                f"holds id {top} (first past the vocabulary at token {where}), but the vocabulary has {vocab} ids",
            )

    def verify(self) -> list[str]:
        """Compare each file with the sha256 its writer recorded, skipping those verified.json vouches for at their
        current size, modification time and sample (trusted instead: hashed in full later, once per job, by
        train.py); record the verdict. Returns the files hashed."""
        recorded = self.meta["sha256"]
        stats = _stats(self.folder)  # before hashing: a file that changes meanwhile is hashed again
        samples = _samples(self.folder)
        trusted = _trusted(self.folder, recorded, stats, samples)
        hashed = []
        for name in DATA_FILES:
            if name in trusted:
                trust(self.folder / name, recorded[name], lambda found, name=name: self._changed(name))
                continue
            if file_sha256(self.folder / name) != recorded[name]:
                raise self._damaged(name, "does not match the sha256 recorded when the store was built")
            hashed.append(name)
        if hashed:
            record_verified(self.folder, recorded, stats, samples)
        return hashed

    def _changed(self, name: str) -> str:
        """The full check found `name` changed under a verdict that vouched for it: drop the verdict, so that the next
        open hashes every file and rebuilds the store; the line that stops the run."""
        with contextlib.suppress(OSError):
            (self.folder / VERIFIED_FILE).unlink()
        source = self.meta.get("source") or "the TSV it was built from"
        return (
            f"token store {self.folder}: {name} does not match the sha256 recorded when the store was built, "
            f"though its size and modification time are the ones its last check saw (ids changed in place); its "
            f"verdict is dropped: run the same command again and train.py rebuilds the store from {source}"
        )

    def lengths(self, side: str, idx: np.ndarray | None = None) -> np.ndarray:
        """Stored (kept) tokens per pair, int64: all pairs, or those of `idx`."""
        off = self.offsets[side]
        if idx is None:
            return np.diff(off)
        return off[idx + 1] - off[idx]

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file())

    def padded_rows(
        self, side: str, idx: np.ndarray, width: int, pad: int, lead: int | None = None, end: int | None = None
    ) -> np.ndarray:
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


def _stats(folder: Path) -> dict:
    """{file: [size, mtime_ns]} of the data files (a missing file: absent)."""
    out = {}
    for name in DATA_FILES:
        with contextlib.suppress(OSError):
            st = (folder / name).stat()
            out[name] = [st.st_size, st.st_mtime_ns]
    return out


def _samples(folder: Path) -> dict:
    """{file: sample_sha256} of the data files there are (what a verdict also vouches for)."""
    out = {}
    for name in DATA_FILES:
        with contextlib.suppress(OSError):
            out[name] = sample_sha256(folder / name)
    return out


def _trusted(folder: Path, recorded: dict, stats: dict, samples: dict) -> set:
    """The files verified.json vouches for: same sha256 as meta.json, same size, mtime and sample as now, and an
    mtime before the verdict's own (one within the same clock tick may hide a later change). A verdict without
    samples (from before they were kept) vouches for nothing: the store is hashed once more."""
    path = folder / VERIFIED_FILE
    try:
        when = path.stat().st_mtime_ns
        with open(path, encoding="utf-8") as f:
            verdict = json.load(f)
        return {
            name
            for name in DATA_FILES
            if verdict["sha256"].get(name) == recorded[name]
            and verdict["files"].get(name) == stats.get(name)
            and stats[name][1] < when
            and verdict["samples"].get(name) == samples.get(name)
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()  # no verdict (or an unreadable one): hash


def record_verified(folder: Path, recorded: dict, stats: dict, samples: dict) -> None:
    """Write verified.json (atomically). A folder this process cannot write keeps no verdict: its next open hashes
    again, which costs time but is still safe."""
    with contextlib.suppress(OSError), atomic_write(folder / VERIFIED_FILE) as f:
        json.dump({"sha256": recorded, "files": stats, "samples": samples}, f, indent=1)
        f.write("\n")
