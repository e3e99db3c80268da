"""Strict text input/output shared by every preprocess tool (the one home for these rules).

- `iter_lines(path)` / `read_lines(path)`: plain or `.gz` text, decoded strictly as UTF-8. A missing file,
  an empty file and a line that is not valid UTF-8 each raise `UserError` naming the file (and the 1-based line).
- `decode_lines(data, name)`: the same rules for bytes already in memory (a member of a tar archive).
- `atomic_write(path)`: a file that appears complete under its final name or not at all.
- `check_output_file(path, what)`, `refuse_output_over_inputs(output, what, inputs)`: before any work, an output
  that can be written and is none of the command's inputs (not even through a link or another spelling).
- `iter_tsv_pairs(path)` / `read_tsv_pairs(path)`: `source<TAB>target` lines; a malformed line raises
  `UserError("FILE:LINE: ...")`.
- `LineBlocks(path, block_bytes)`: a file in blocks of whole lines (bytes), hashing the file as it is read, and
  `split_tsv_block(block, name, first_lineno)`: a block's pairs by the rules above (for corpora read in chunks).

Library only; nothing to run.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from common.errors import fail

PathLike = str | os.PathLike


def _is_gzip(path: Path) -> bool:
    return path.name.endswith(".gz")


def check_readable(path: PathLike) -> Path:
    """Return `path` as a Path, or raise UserError if it is missing, not a file, or zero bytes long."""
    path = Path(path)
    if not path.exists():
        fail(f"{path}: file not found")
    if not path.is_file():
        fail(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        fail(f"{path}: file is empty")
    return path


def decode_line(raw: bytes, name: str, lineno: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(f"{name}:{lineno}: invalid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line); "
             "convert the file to UTF-8 first")
    if lineno == 1 and text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark is an editor artefact, not part of the first sentence
    # Only "\n" ends a line (binary iteration): str.splitlines() would also split on U+2028 or \x85 inside a
    # sentence and silently misalign two parallel files.
    return text.rstrip("\r\n")


def _iter_raw(handle: Iterable[bytes], name: str) -> Iterator[tuple[int, str]]:
    lineno = 0
    for lineno, raw in enumerate(handle, start=1):
        yield lineno, decode_line(raw, name, lineno)
    if lineno == 0:
        fail(f"{name}: file is empty")


def iter_lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, line without its newline) from a plain or gzip-compressed UTF-8 file."""
    path = check_readable(path)
    name = str(path)
    opener = gzip.open if _is_gzip(path) else open
    try:
        with opener(path, "rb") as handle:
            yield from _iter_raw(handle, name)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        fail(f"{name}: not a valid gzip file ({exc}); re-download it or drop the .gz suffix if it is plain text")


def read_lines(path: PathLike) -> list[str]:
    return [line for _, line in iter_lines(path)]


def decode_lines(data: bytes, name: str) -> list[str]:
    """The rules of `iter_lines` for bytes already in memory; `name` is what error messages call the file."""
    return [line for _, line in _iter_raw(data.splitlines(keepends=True), name)]


def count_lines(path: PathLike) -> int:
    return sum(1 for _ in iter_lines(path))


@contextlib.contextmanager
def atomic_write(path: PathLike, encoding: str = "utf-8") -> Iterator[IO[str]]:
    """Write text to `path` so that readers see either the old file (or none) or the complete new one.

    The text goes to a hidden temporary file in the same directory (same filesystem, so `os.replace` is atomic),
    is fsynced, and replaces `path` only when the block finishes without an exception; on any error, including
    KeyboardInterrupt, the temporary file is removed. Missing folders above it are created (translate.py --output
    new/out.txt traced back after decoding).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline="\n") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the result is an ordinary data file
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def split_tsv_line(line: str, name: str, lineno: int) -> tuple[str, str]:
    """Split one `source<TAB>target` line, stripping both sides; raise UserError("FILE:LINE: ...") if malformed."""
    tabs = line.count("\t")
    if tabs == 0:
        what = "empty line" if not line.strip() else "no tab"
        fail(f"{name}:{lineno}: {what}; expected 'source<TAB>target'")
    if tabs > 1:
        fail(f"{name}:{lineno}: {tabs} tabs; expected exactly one between source and target "
             "(a sentence must not contain a tab)")
    src, tgt = (side.strip() for side in line.split("\t"))
    if not src:
        fail(f"{name}:{lineno}: empty source side (before the tab)")
    if not tgt:
        fail(f"{name}:{lineno}: empty target side (after the tab)")
    return src, tgt


def iter_tsv_pairs(path: PathLike) -> Iterator[tuple[str, str]]:
    name = str(path)
    for lineno, line in iter_lines(path):
        yield split_tsv_line(line, name, lineno)


def read_tsv_pairs(path: PathLike) -> tuple[list[str], list[str]]:
    """Return (sources, targets) of a TSV file, validated line by line."""
    sources: list[str] = []
    targets: list[str] = []
    for src, tgt in iter_tsv_pairs(path):
        sources.append(src)
        targets.append(tgt)
    return sources, targets


def split_tsv_block(block: bytes, name: str, first_lineno: int) -> tuple[list[str], list[str]]:
    """(sources, targets) of a block of whole `source<TAB>target` lines as read from the file ("\n"-separated, the
    last newline optional), by the rules of `iter_tsv_pairs`; `first_lineno` is the block's first line number in
    the file, for the messages."""
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:                     # find the line, for the message
        for offset, raw in enumerate(block.split(b"\n")):
            decode_line(raw, name, first_lineno + offset)
        raise
    lines = text.split("\n")                       # only "\n" ends a line (see decode_line)
    if lines[-1] == "":
        lines.pop()
    if first_lineno == 1 and lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]
    sources, targets = [], []
    for offset, line in enumerate(lines):
        src, tgt = split_tsv_line(line.rstrip("\r"), name, first_lineno + offset)
        sources.append(src)
        targets.append(tgt)
    return sources, targets


class _HashingReader(io.RawIOBase):
    """A raw file whose bytes are hashed (sha256) and counted as they are read."""

    def __init__(self, raw):
        self.raw, self.digest, self.consumed = raw, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        if n:
            self.digest.update(memoryview(buffer)[:n])
            self.consumed += n
        return n


class LineBlocks:
    """Iterate a plain or `.gz` text file as (block, first line number): blocks of about `block_bytes` bytes of
    whole lines (a block ends after a "\n", the file's last line may lack it). Reading hashes the file's bytes:
    after the iteration `sha256` is their hex digest; `consumed` / `size` is how far the reading has come."""

    def __init__(self, path: PathLike, block_bytes: int = 4 << 20):
        self.path = check_readable(path)
        self.block_bytes = block_bytes
        self.size = self.path.stat().st_size
        self.consumed, self.sha256 = 0, None

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        name = str(self.path)
        with open(self.path, "rb", buffering=0) as raw:
            hashing = _HashingReader(raw)
            # no read-ahead buffer between: `consumed` then says how far the blocks have come (to within gzip's
            # small input buffer), which the store writer's projection of its final size relies on
            stream = gzip.GzipFile(fileobj=hashing, mode="rb") if _is_gzip(self.path) else hashing
            carry, lineno = b"", 1
            try:
                while True:
                    data = stream.read(self.block_bytes)
                    self.consumed = hashing.consumed
                    if not data:
                        break
                    data = carry + data
                    cut = data.rfind(b"\n") + 1
                    if cut == 0:
                        carry = data                  # a line longer than a block: read on
                        continue
                    block, carry = data[:cut], data[cut:]
                    yield block, lineno
                    lineno += block.count(b"\n")
            except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
                fail(f"{name}: not a valid gzip file ({exc}); re-download it or drop the .gz suffix if it is plain "
                     "text")
            if carry:
                yield carry, lineno
            self.sha256 = hashing.digest.hexdigest()


def read_json(path: PathLike, what: str):
    """A JSON file the user points at (recipe, rank table, DeepSpeed config): a missing file, a folder, a syntax
    error, bytes that are not UTF-8 and a key given twice in one object (JSON would silently keep the last) are each
    a one-line UserError naming `what` and the path."""
    import json
    if os.path.isdir(path):
        fail(f"{what} {path} is a folder; give the JSON file")
    if not os.path.isfile(path):
        fail(f"{what} {path} not found")

    def no_duplicates(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                fail(f"{what} {path}: the key {json.dumps(key)} appears twice in one object; JSON keeps only the "
                     f"last one, so delete the one you did not mean")
            seen.add(key)
        return dict(pairs)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        fail(f"{what} {path} is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}")
    except UnicodeDecodeError as exc:
        fail(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})")


def nearest_existing(path: PathLike) -> Path:
    """`path` made absolute, or the nearest folder above it that exists (where creating it would start)."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    return existing


def check_output_file(path: PathLike, what: str) -> Path:
    """Before any work: `path` can become a file — it is not a folder, and no folder above it is a file. Returns it
    as a Path (its folder is created by the writer)."""
    path = Path(path)
    if path.is_dir():
        fail(f"{what} {path} is a folder; give a file name (e.g. {path / 'out'})")
    parent = nearest_existing(path.absolute().parent)
    if not parent.is_dir():
        fail(f"{what} {path} cannot be written: {parent} is a file, not a folder")
    return path


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether `a` and `b` are one file on disk: the same path spelled otherwise (./x, d/../x), a symbolic link to
    it, a hard link (same device and inode). False when either does not exist."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def refuse_output_over_inputs(output: PathLike, what: str, inputs: Iterable[tuple[str, PathLike | None]]) -> None:
    """Before any work: `output` is none of the files the command reads, each given as (how to name it to the user,
    e.g. "--src a.txt"; its path, None when not given). A command writes its output once the work is done
    (atomic_write), so an output that is an input would silently replace it (evaluate.py --src F --output F left
    the hypotheses in F, exit 0)."""
    for label, path in inputs:
        if path is not None and same_file(output, path):
            other = str(path) in label and os.path.abspath(output) != os.path.abspath(path)
            fail(f"{what} {output} is {label}{' (the same file under another name)' if other else ''}: writing "
                 f"there would replace what the command reads; give another output file")
