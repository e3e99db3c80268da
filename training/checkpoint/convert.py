"""Format 1 → format 2: the torch .pt checkpoints written before safetensors, converted once (no tensor changes).

Format 1 (training/checkpoint.py up to commit 00ba1aa): `shard_pp{P}_tp{T}.pt` = torch.save({name: {"param",
"exp_avg", "exp_avg_sq", "partition_dim", "full_size"}}), `rng_rank{R}.pt` = torch.save(RNG.get_state()), and a
meta.json with "format_version": 1. It is read with torch.load(weights_only=True) — tensors, numbers and None only,
no code runs — and written as format 2 with the same fp32 weights, moments, RNG states and data position; the
optimizer that saved it was not recorded in format 1.
"""

from __future__ import annotations

import json
import os
import secrets

import torch

from common.errors import UserError
from common.staging import staged_folder
from training.checkpoint.folder import resolve
from training.checkpoint.format import (
    FORMAT_VERSION,
    check_layout,
    check_meta,
    rng_file,
    rng_tensors,
    shard_file,
    write_shard_file,
)
from training.checkpoint.recovery_script import ship_recovery_files
from training.checkpoint.shard_io import write_tensors


def _load_pt(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means a damaged (or not format-1) file
        raise UserError(
            f"checkpoint file {path} is corrupt, truncated or not a format-1 file "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        ) from exc


def _read_format_1(old: str) -> dict:
    """meta.json of the format-1 checkpoint `old`, an object whose format_version is 1 (else one UserError line)."""
    meta_path = os.path.join(old, "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise UserError(f"{meta_path} cannot be read ({exc}); the file was damaged — use another checkpoint") from exc
    if not isinstance(meta, dict):
        raise UserError(
            f"{meta_path} holds {json.dumps(meta)[:40]}, not the object a checkpoint's meta.json is; the "
            f"file was edited or damaged — use another checkpoint"
        )
    if meta.get("format_version") != 1:
        raise UserError(
            f"{old} is not a format-1 checkpoint (its meta.json says format {meta.get('format_version')})"
            f"; only format 1 needs converting"
        )
    return meta


def _format_2_meta(meta: dict, old: str) -> dict:
    """The converted meta.json, less the files' digests: the old one's fields checked as format 2 reads them (a
    malformed one is one line naming the field, before anything is written), new identities, the new file names."""
    meta_path = os.path.join(old, "meta.json")
    parallel, world = meta.get("parallel"), meta.get("world_size")
    for key, bad, kind in (
        ("parallel", not isinstance(parallel, dict), "an object"),
        ("world_size", isinstance(world, bool) or not isinstance(world, int) or world < 1, "an integer >= 1"),
    ):
        if bad:  # what the file names below are made of
            what = "missing" if key not in meta else f"{json.dumps(meta[key])[:40]}, not {kind}"
            raise UserError(
                f"{meta_path}: field {key!r} is {what}; the file was edited or damaged — use another checkpoint"
            )
    check_layout(parallel, meta_path)
    pp, tp = meta["parallel"]["pipeline_stage"], meta["parallel"]["model_parallel"]
    ids = {
        "checkpoint_id": f"{secrets.randbits(62):016x}",
        "run_id": f"{secrets.randbits(62):016x}",
        "step": meta.get("step"),
    }
    out = {
        **{k: v for k, v in meta.items() if k not in ("shards", "rng")},
        **ids,
        "format_version": FORMAT_VERSION,
        "skipped_steps": 0,
        "shards": [shard_file(p, t) for p in range(pp) for t in range(tp)],
        "rng": [rng_file(r) for r in range(world)],
        "sha256": {},
        "optimizer": {
            "class": "unknown (converted from format 1)",
            "kind": "",
            "precision": "unknown",
            "zero_stage": "unknown",
        },
        "converted_from": os.path.abspath(old),
    }
    check_meta(out, old, meta_path)  # the step against the folder's name too
    return out


def convert_format_1(old: str, new: str) -> dict:
    """Write the format-1 checkpoint `old` (a step folder, or a run's / checkpoints/ folder → its latest) as a
    format-2 checkpoint folder `new`, which must not exist. It is written into a staging folder of its own beside
    `new` (common.staging: a unique name, removed if the conversion fails) and renamed to `new` once complete; no
    other folder is touched. Returns its meta."""
    old = resolve(old)
    meta = _read_format_1(old)
    if os.path.lexists(new):
        raise UserError(f"{new} already exists; name a new folder for the converted checkpoint")
    out = _format_2_meta(meta, old)
    ids = {k: out[k] for k in ("checkpoint_id", "run_id", "step")}
    with staged_folder(new) as tmp:
        sums = out["sha256"]
        for p in range(out["parallel"]["pipeline_stage"]):
            for t in range(out["parallel"]["model_parallel"]):
                entries = _load_pt(os.path.join(old, f"shard_pp{p}_tp{t}.pt"))
                sums[shard_file(p, t)] = write_shard_file(
                    os.path.join(tmp, shard_file(p, t)), entries, {**ids, "pp_rank": p, "tp_rank": t}
                )
        for r in range(out["world_size"]):
            state = _load_pt(os.path.join(old, f"rng_rank{r}.pt"))
            sums[rng_file(r)] = write_tensors(os.path.join(tmp, rng_file(r)), rng_tensors(state), {**ids, "rank": r})
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        ship_recovery_files(tmp)
    return out
