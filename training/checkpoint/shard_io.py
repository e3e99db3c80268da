"""safetensors files written one tensor at a time, and read one slice at a time.

A checkpoint shard holds every parameter of one (pipeline stage, TP rank) with its AdamW moments — 12 bytes per
parameter. `ShardWriter` writes the safetensors header first (names, dtypes and shapes are known before any value
is gathered) and then each tensor as it arrives, so the writing rank never holds more than one gathered tensor; the
file is an ordinary safetensors file (`safetensors.safe_open`, `load_file`, any other reader).

Reading goes through `safetensors.safe_open`, which maps the file: `read_slice` copies out only the rows/columns
asked for and closes the mapping again, so a rank touches only the bytes of the slices it needs.

Integrity: the writer hashes every byte it writes (sha256, the header included) as it writes it, so the digest of the
finished file costs no second read; `file_sha256` (common.hashing) recomputes it at load (training.checkpoint.format).

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}} padded with spaces to a
multiple of 8, then the tensors' bytes back to back in the order of their offsets.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence

import torch

from common.errors import UserError

DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class ShardWriter:
    """Write tensors `specs` = [(name, shape, dtype), ...] in that order to `path` (via `path.part`, renamed on
    `close`, fsynced). `metadata` goes into the header's __metadata__ (string values). After `close`, `sha256` is
    the hex digest of the whole file."""

    def __init__(self, path: str, specs: Sequence[tuple], metadata: dict | None = None):
        self.path, self.tmp = path, path + ".part"
        header, offset, self._expected = {}, 0, []
        for name, shape, dtype in specs:
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": DTYPES[dtype],
                "shape": [int(s) for s in shape],
                "data_offsets": [offset, offset + nbytes],
            }
            self._expected.append((name, tuple(int(s) for s in shape), dtype))
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.tmp, "wb")  # noqa: SIM115 - written piece by piece, closed by finish()
        self._digest = hashlib.sha256()
        self.sha256: str | None = None
        self._put(struct.pack("<Q", len(raw)))
        self._put(raw)
        self._next = 0

    def _put(self, data) -> None:
        self._file.write(data)
        self._digest.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, want_shape, want_dtype = self._expected[self._next]
        if name != want_name or tuple(tensor.shape) != want_shape or tensor.dtype != want_dtype:
            raise RuntimeError(
                f"{self.path}: tensor {self._next} should be {want_name} {want_shape} {want_dtype}, "
                f"got {name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._put(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise RuntimeError(f"{self.path}: {len(self._expected) - self._next} tensors were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        self.sha256 = self._digest.hexdigest()

    def abort(self) -> None:
        self._file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def write_tensors(path: str, tensors: dict, metadata: dict | None = None) -> str:
    """A whole dict {name: tensor} at once (small files: RNG states, tests); returns the file's sha256."""
    writer = ShardWriter(path, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], metadata)
    try:
        for name, t in tensors.items():
            writer.write(name, t)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return writer.sha256


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def read_header(path: str) -> tuple[dict, dict]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, __metadata__) of a safetensors file, reading only its
    header. A file that is not a complete safetensors file is a UserError naming it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            n = struct.unpack("<Q", head)[0]
            if n > MAX_HEADER or 8 + n > size:
                raise ValueError("header length past the end of the file")
            header = json.loads(f.read(n))
        metadata = header.pop("__metadata__", None) or {}
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if 8 + n + end != size:
            raise ValueError(f"the header describes {8 + n + end} bytes, the file has {size}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"checkpoint file {path} is corrupt or truncated ({type(exc).__name__}: {exc})") from exc
    return header, metadata


def read_slice(path: str, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Tensor `name` of `path`, or only [start, stop) along `dim`, as a fresh tensor (the file's mapping is
    released before returning)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            view = f.get_slice(name)
            if dim is None:
                out = view[:]
            else:
                index = [slice(None)] * len(view.get_shape())
                index[dim] = slice(start, stop)
                out = view[tuple(index)]
            return out.clone()  # off the mapping: the mapping closes with the file
    except SafetensorError as exc:
        raise UserError(f"checkpoint file {path} is corrupt or truncated (SafetensorError: {exc})") from exc


def read_all(path: str) -> dict:
    """Every tensor of a (small) safetensors file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except SafetensorError as exc:
        raise UserError(f"checkpoint file {path} is corrupt or truncated (SafetensorError: {exc})") from exc
