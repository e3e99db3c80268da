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
import shutil

import torch

from common.errors import UserError
from training.checkpoint.folder import resolve
from training.checkpoint.format import FORMAT_VERSION, rng_file, rng_tensors, shard_file, write_shard_file
from training.checkpoint.recovery_script import ship_recovery_files
from training.checkpoint.shard_io import write_tensors


def _load_pt(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged (or not format-1) file
        raise UserError(f"checkpoint file {path} is corrupt, truncated or not a format-1 file "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc


def convert_format_1(old: str, new: str) -> dict:
    """Write the format-1 checkpoint `old` (a step folder, or a run's / checkpoints/ folder → its latest) as a
    format-2 checkpoint folder `new` (which must not exist; written as new.tmp, then renamed). Returns its meta."""
    old = resolve(old)
    with open(os.path.join(old, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format_version") != 1:
        raise UserError(f"{old} is not a format-1 checkpoint (its meta.json says format {meta.get('format_version')})"
                        f"; only format 1 needs converting")
    if os.path.exists(new):
        raise UserError(f"{new} already exists; name a new folder for the converted checkpoint")
    tmp = new.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    ids = {"checkpoint_id": f"{secrets.randbits(62):016x}", "run_id": f"{secrets.randbits(62):016x}",
           "step": meta["step"]}
    parallel = meta["parallel"]
    shards, rngs, sums = [], [], {}
    for p in range(parallel["pipeline_stage"]):
        for t in range(parallel["model_parallel"]):
            entries = _load_pt(os.path.join(old, f"shard_pp{p}_tp{t}.pt"))
            shards.append(shard_file(p, t))
            sums[shards[-1]] = write_shard_file(os.path.join(tmp, shards[-1]), entries,
                                                {**ids, "pp_rank": p, "tp_rank": t})
    for r in range(meta["world_size"]):
        state = _load_pt(os.path.join(old, f"rng_rank{r}.pt"))
        rngs.append(rng_file(r))
        sums[rngs[-1]] = write_tensors(os.path.join(tmp, rngs[-1]), rng_tensors(state), {**ids, "rank": r})
    out = {**{k: v for k, v in meta.items() if k not in ("shards", "rng")}, **ids,
           "format_version": FORMAT_VERSION, "skipped_steps": 0, "shards": shards, "rng": rngs, "sha256": sums,
           "optimizer": {"class": "unknown (converted from format 1)", "kind": "", "precision": "unknown",
                         "zero_stage": "unknown"}, "converted_from": os.path.abspath(old)}
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    ship_recovery_files(tmp)
    os.replace(tmp, new)
    return out
