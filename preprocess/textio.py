"""Parallel text for the data preparation: `source<TAB>target` lines, whole or in blocks.

- `iter_tsv_pairs(path)` / `read_tsv_pairs(path)`: `source<TAB>target` lines; a malformed line raises
  `UserError("FILE:LINE: ...")`.
- `LineBlocks(path, block_bytes)`: a file in blocks of whole lines (bytes), hashing the file as it is read, and
  `split_tsv_block(block, name, first_lineno)`: a block's pairs by the rules above (for corpora read in chunks).

Lines are read by the rules of common.text_lines (strict UTF-8, plain or .gz); outputs are written with
common.staging.atomic_write. Library only; nothing to run.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from collections.abc import Iterator

from common.errors import fail
from common.text_lines import PathLike, check_readable, decode_line, is_gzip, iter_lines

# Still importable from here, though its home is common.user_files: the copies of zero_to_fp32.py that checkpoints
# already saved import refuse_output_over_inputs from this module (a saved copy is never updated).
from common.user_files import refuse_output_over_inputs  # noqa: F401 - for those saved copies


def split_tsv_line(line: str, name: str, lineno: int) -> tuple[str, str]:
    """Split one `source<TAB>target` line, stripping both sides; raise UserError("FILE:LINE: ...") if malformed."""
    tabs = line.count("\t")
    if tabs == 0:
        what = "empty line" if not line.strip() else "no tab"
        fail(f"{name}:{lineno}: {what}; expected 'source<TAB>target'")
    if tabs > 1:
        fail(
            f"{name}:{lineno}: {tabs} tabs; expected exactly one between source and target "
            "(a sentence must not contain a tab)"
        )
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
    except UnicodeDecodeError:  # find the line, for the message
        for offset, raw in enumerate(block.split(b"\n")):
            decode_line(raw, name, first_lineno + offset)
        raise
    lines = text.split("\n")  # only "\n" ends a line (see decode_line)
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
            stream = gzip.GzipFile(fileobj=hashing, mode="rb") if is_gzip(self.path) else hashing
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
                        carry = data  # a line longer than a block: read on
                        continue
                    block, carry = data[:cut], data[cut:]
                    yield block, lineno
                    lineno += block.count(b"\n")
            except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
                fail(
                    f"{name}: not a valid gzip file ({exc}); re-download it or drop the .gz suffix if it is plain text"
                )
            if carry:
                yield carry, lineno
            self.sha256 = hashing.digest.hexdigest()
