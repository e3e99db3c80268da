"""A text file a user gives, read line by line under one set of strict rules (plain or `.gz`, UTF-8).

- `iter_lines(path)` / `read_lines(path)` / `count_lines(path)`: a missing file, an empty file and a line that is not
  valid UTF-8 each raise `UserError` naming the file (and the 1-based line).
- `decode_lines(data, name)`: the same rules for bytes already in memory (a member of a tar archive).
- `decode_line(raw, name, lineno)`: one line by them (a stream read as it comes: translate.py's stdin).

Here, not in preprocess/, because translate.py, evaluate.py and the benchmarks read their text by the same rules as
the data preparation does.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from common.errors import fail

PathLike = str | os.PathLike


def is_gzip(path: Path) -> bool:
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
        fail(
            f"{name}:{lineno}: invalid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line); "
            "convert the file to UTF-8 first"
        )
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
    opener = gzip.open if is_gzip(path) else open
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
