"""Lines of a pipe or terminal in the groups they arrive in, so a translator can answer each line as soon as it
is read (fairseq-interactive's --buffer-size, with the buffer being whatever has already arrived).

Each group is every complete line that can be read without waiting — at least one, so an interactive user gets
an answer per line; a whole file poured into a pipe comes in groups of a pipe's capacity (64 KiB on Linux), big
enough for full decoding batches. A last line without its newline is given at the end of the stream.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterator

# the rules every other reader of text follows: UTF-8 or one `error:` line naming the line, a byte-order mark on the
# first line dropped, only "\n" ends a line
from common.text_lines import decode_line

CHUNK = 1 << 16


def _readable_now(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def arriving_lines(fd: int, name: str = "stdin") -> Iterator[list[str]]:
    """Yield lists of decoded lines from the file descriptor `fd` until its end; `name` is what errors call it.
    Reads with os.read (no buffer of Python's between the pipe and select, which would hide lines already read)."""
    pending, lineno, ended = b"", 0, False
    while not ended:
        while b"\n" not in pending and not ended:  # wait for one complete line (or the end)
            chunk = os.read(fd, CHUNK)
            pending += chunk
            ended = not chunk
        while not ended and _readable_now(fd):  # and take whatever else has arrived meanwhile
            chunk = os.read(fd, CHUNK)
            pending += chunk
            ended = not chunk
        if ended:
            ready, pending = pending, b""
        else:
            cut = pending.rindex(b"\n") + 1
            ready, pending = pending[:cut], pending[cut:]
        group = []
        lines = ready.split(b"\n")  # "\n" alone ends a line (bytes.splitlines: \r too)
        if lines[-1] == b"":
            lines.pop()
        for raw in lines:
            lineno += 1
            group.append(decode_line(raw, name, lineno))
        if group:
            yield group


def is_stream(fd: int) -> bool:
    """A pipe, socket or terminal (lines may still be coming), not a regular file (all there: read it at once)."""
    import stat

    return not stat.S_ISREG(os.fstat(fd).st_mode)
