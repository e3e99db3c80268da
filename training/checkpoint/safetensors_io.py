"""A consolidated state dict (training.checkpoint.consolidated) as one .safetensors file, and back.

The tensors are the serial model's fp32 state dict under its own names (what `load_state_dict` takes, and what any
safetensors reader sees); everything else the .pt form holds goes into the header's string metadata, JSON-encoded,
so evaluate.py / translate.py / export_hf.py load the file as they load a merged .pt. `tensors_sha256` is a digest of
the tensors themselves (names, dtypes, shapes, bytes in name order): the file cannot hold its own file hash, and this
one is checked on every load, like a checkpoint's files.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from common.errors import UserError
from common.staging import staged_file

FORMAT = "ds-transformer-recipes consolidated fp32 state dict"
# the .pt dict's fields besides "model" that go into the metadata (JSON); others are refused rather than dropped
FIELDS = (
    "model_config",
    "step",
    "saved_layout",
    "tokenizer_sha256",
    "tokenizer_json",
    "checkpoint",
    "source_sha256",
    "averaged",
    "tokenizer_problem",
)


def tensors_sha256(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # the bytes, not a copy of them
    return h.hexdigest()


def write(obj: dict, path: str) -> None:
    """obj (a consolidated dict) → path, atomically (a staging file renamed into place, its mode that of any new
    file: 0666 less the umask)."""
    from safetensors.torch import save_file

    extra = sorted(set(obj) - set(FIELDS) - {"model"})
    if extra:
        raise UserError(
            f"{path}: a .safetensors output holds the weights only, not {', '.join(extra)}; write a .pt file for those"
        )
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in obj["model"].items()}
    metadata = {"format": FORMAT, "tensors_sha256": tensors_sha256(tensors)}
    metadata.update({k: json.dumps(obj[k]) for k in FIELDS if obj.get(k) is not None})
    if isinstance(obj.get("checkpoint"), str) and os.path.isdir(obj["checkpoint"]):  # the source, wherever it is read
        metadata["checkpoint"] = json.dumps(os.path.abspath(obj["checkpoint"]))
    # a staging name of its own (a user's PATH.part stays), removed if the write fails; renamed with the mode of an
    # ordinary file (save_file makes it 0600; a state dict to share is not private)
    with staged_file(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def read(path: str, verify: bool = True) -> dict:
    """A .safetensors file written by `write` → the consolidated dict; its tensors checked against the digest in
    its header unless `verify` is False. Anything else is one UserError naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{path} is not a readable .safetensors file: {str(exc).splitlines()[0][:200]}") from None
    if metadata.get("format") != FORMAT:
        raise UserError(
            f"{path} is a .safetensors file without this repository's metadata (format "
            f"{metadata.get('format')!r}): write it with run_scripts/merge_checkpoint.py, or load its "
            f"tensors yourself"
        )
    if verify and tensors_sha256(tensors) != metadata.get("tensors_sha256"):
        raise UserError(
            f"{path} does not match the tensors_sha256 in its header (the file changed after it was "
            f"written); merge the checkpoint again, or pass --no_verify to load it anyway"
        )
    obj = {"model": tensors}
    try:
        obj.update({k: json.loads(metadata[k]) for k in FIELDS if k in metadata})
    except ValueError as exc:
        raise UserError(f"{path}: its header's metadata is not valid JSON ({exc})") from None
    return obj
