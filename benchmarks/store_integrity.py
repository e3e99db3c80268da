#!/usr/bin/env python3
"""What the token store's integrity checks cost (preprocess/token_store.py), on synthetic stores of WMT-like pairs.

    python -m benchmarks.store_integrity --work out/store_integrity --sizes 1M 4.5M

For each size: a store of `pairs` random pairs written by StoreWriter (each side 5-50 ids of a 32k vocabulary, 27.5
on average: the 57 real tokens a pair of the data_scale.py corpora, whose 4.5 M-pair store is 572 MB), then

- the write, and the part of it the streamed sha256 takes (the same bytes hashed again, alone);
- an open that verifies every file (no verdict yet: what the first open of a copied store costs);
- an open whose verdict vouches for every file: the structural checks alone (every later open on the verifying
  process of each node);
- an open without verification (a node's other ranks): the structural checks too;
- the full hash of every file the trusted open took on its verdict (what train.py's check beside the first steps,
  training.core.data_recheck, costs: on a thread, once per job).

`--corpus TSV` also times the corpus's identity at a start (preprocess.tsv_digest.tsv_sha256): the first start,
which hashes the file and records it, and a later one, which reads the record and checks a 1 MiB sample of the
file; and the full hash the check beside the first steps makes of it. Make a corpus with benchmarks/data_scale.py
(`make_corpus`: 4.5 M pairs, 1.2 GB).

The page cache is warm (the store was just written or read): a cold open also reads the files from disk once. Prints
one JSON object per size; the stores stay under --work (delete it afterwards).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

VOCAB = 32_000
CHUNK = 200_000


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1], 1)
    return int(round(float(text[:-1] if scale > 1 else text) * scale))


def write_store(folder: Path, pairs: int, seed: int = 0) -> float:
    """A store of `pairs` random pairs at `folder`; returns the seconds the write took."""
    from preprocess.token_store import StoreWriter, TokenChunk, token_dtype

    rng = np.random.default_rng(seed)
    dtype = token_dtype(VOCAB)
    start = time.perf_counter()
    with StoreWriter(folder, dtype, "synthetic") as writer:
        for first in range(0, pairs, CHUNK):
            n = min(CHUNK, pairs - first)
            sides = []
            for _ in range(2):
                lengths = rng.integers(5, 51, n).astype(np.int64)
                sides += [rng.integers(4, VOCAB, int(lengths.sum())).astype(dtype), lengths]
            writer.append(TokenChunk(*sides, flags=np.zeros(n, np.uint8)), (first + n) / pairs)
        writer.commit({"src_len": 51, "tgt_len": 51, "vocab_size": VOCAB})
    return time.perf_counter() - start


def hash_alone(folder: Path) -> float:
    """Seconds to sha256 the store's data files from memory (the writer's added work, without the writes)."""
    from preprocess.token_store import DATA_FILES

    data = [np.fromfile(folder / name, dtype=np.uint8) for name in DATA_FILES]
    start = time.perf_counter()
    for array in data:
        hashlib.sha256(memoryview(array)).hexdigest()
    return time.perf_counter() - start


def timed_open(folder: Path, verify: bool) -> tuple[float, list]:
    from preprocess.token_store import TokenStore

    start = time.perf_counter()
    store = TokenStore(folder, verify=verify)
    return time.perf_counter() - start, store.hashed


def measure(work: Path, pairs: int) -> dict:
    from preprocess.token_store import VERIFIED_FILE

    folder = work / f"store-{pairs}"
    shutil.rmtree(folder, ignore_errors=True)
    write_s = write_store(folder, pairs)
    size = sum(p.stat().st_size for p in folder.iterdir())
    (folder / VERIFIED_FILE).unlink()  # as a copy without the writer's verdict
    verify_s, hashed = timed_open(folder, verify=True)
    assert len(hashed) == 5, hashed
    trusted = [timed_open(folder, verify=True) for _ in range(3)]
    assert all(h == [] for _, h in trusted), trusted
    other = [timed_open(folder, verify=False)[0] for _ in range(3)]
    return {
        "pairs": pairs,
        "store_bytes": size,
        "write_s": round(write_s, 2),
        "sha256_in_write_s": round(hash_alone(folder), 2),
        "open_verify_all_s": round(verify_s, 2),
        "open_verdict_trusted_s": round(min(t for t, _ in trusted), 3),
        "open_no_verify_s": round(min(other), 3),
        "full_check_s": full_check(),
    }


def full_check() -> float | None:
    """Seconds to hash in full the files the opens so far took on trust (None where this code trusts nothing)."""
    try:
        from preprocess.trusted_files import first_mismatch, take
    except ImportError:  # the code before the check beside the first steps
        return None
    files = take()
    start = time.perf_counter()
    assert first_mismatch(files) is None
    return round(time.perf_counter() - start, 2)


def corpus_identity(tsv: Path, work: Path) -> dict:
    """The corpus's identity at a first start (hashed and recorded) and at later ones (the record, and this code's
    sample), then the full check of a trusted one."""
    from preprocess.tsv_digest import tsv_sha256

    cache = work / "corpus-cache"
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    tsv_sha256(tsv, cache)
    first = time.perf_counter() - start
    later = []
    for _ in range(5):
        start = time.perf_counter()
        tsv_sha256(tsv, cache)
        later.append(time.perf_counter() - start)
    return {
        "corpus_bytes": tsv.stat().st_size,
        "first_start_s": round(first, 2),
        "later_start_s": round(min(later), 4),
        "later_start_max_s": round(max(later), 4),
        "full_check_s": full_check(),
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--work", default=str(ROOT / "out" / "store_integrity"), help="where the stores go")
    p.add_argument("--sizes", nargs="+", default=["1M", "4.5M"], help="pairs per store (1M, 4.5M, ...)")
    p.add_argument("--corpus", default=None, help="a TSV: also time its identity at a start (see below)")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.corpus:
        print(json.dumps(corpus_identity(Path(args.corpus), work)), flush=True)
    for size in args.sizes:
        print(json.dumps(measure(work, parse_size(size))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
