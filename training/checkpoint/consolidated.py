"""One fp32 state dict of the serial model, from training checkpoints: merged from any layout, or averaged.

The consolidated form is a dict {"model": {name: fp32 tensor}, "model_config": {...}, "step": N, "saved_layout":
{...}, "tokenizer_sha256": ..., "tokenizer_json": the text of the run's tokenizer.json (when the checkpoint recorded
it: a .pt then decodes with no --tokenizer), "source_sha256" (meta.json's digests of the files merged), and for an
average "averaged": [{"checkpoint", "step"}, ...]}. run_scripts/merge_checkpoint.py and
run_scripts/average_checkpoints.py write it (`save`: by the output's extension, torch.save of that dict, a
.safetensors of its state dict with the rest as metadata — training.checkpoint.safetensors_io — or a .bin holding the
bare state dict, as DeepSpeed's zero_to_fp32 writes); evaluate.py and export_hf.py take a .pt or .safetensors
wherever they take a checkpoint folder (`load`). Checkpoint folders are read only
through training.checkpoint.manager's public functions (resolve, read_meta, load_full_state, check_compatible).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from common.errors import UserError
from common.staging import staged_file
from model.config import ModelConfig
from training.checkpoint import safetensors_io
from training.checkpoint.folder import checkpoint_files, resolve
from training.checkpoint.format import (
    check_compatible,
    load_full_state,
    read_meta,
    recorded_tokenizer,
    refuse_non_finite,
)

KEYS = ("model", "model_config", "step")
SAFETENSORS = ".safetensors"


def merge(path: str, with_optimizer: bool = False, verify: bool = True) -> dict:
    """The checkpoint at `path` (a step folder, or a run's / checkpoints/ folder → its latest) as one serial state
    dict, whatever layout saved it (its files checked against their sha256 unless `verify` is False; non-finite
    weights refused)."""
    path = resolve(path)
    meta = read_meta(path)
    full = load_full_state(path, meta, verify=verify)
    out = {
        "model": {name: v["param"] for name, v in sorted(full.items())},
        "model_config": meta["model"],
        "step": meta["step"],
        "saved_layout": meta["parallel"],
        "tokenizer_sha256": meta.get("tokenizer_sha256"),
        "checkpoint": path,
        "source_sha256": meta.get("sha256") or None,
    }
    try:
        tokenizer = recorded_tokenizer(path, meta)
    except UserError as exc:  # a missing or changed copy: the reader may still be given the tokenizer
        tokenizer, out["tokenizer_problem"] = None, str(exc)
    if tokenizer is not None:
        with open(tokenizer, encoding="utf-8") as f:
            out["tokenizer_json"] = f.read()
    if with_optimizer:
        if meta.get("weights_only"):
            raise UserError(f"{path} holds weights only (no AdamW moments); merge it without --with_optimizer")
        out["optimizer"] = {
            name: {"exp_avg": v["exp_avg"], "exp_avg_sq": v["exp_avg_sq"]} for name, v in sorted(full.items())
        }
        out["optimizer_step"] = meta["optimizer_step"]
    return out


def load(path: str, verify: bool = True) -> dict:
    """A consolidated .pt or .safetensors file (merge_checkpoint.py, average_checkpoints.py), or a checkpoint folder
    merged now. Weights that are not finite are refused either way, naming the tensor."""
    if not os.path.isfile(path):
        return merge(path, verify=verify)
    if path.endswith(SAFETENSORS):
        obj = safetensors_io.read(path, verify=verify)
        obj.setdefault("checkpoint", path)
        for name, tensor in obj["model"].items():
            refuse_non_finite(name, tensor, path)
        return obj
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means it is not our file
        raise UserError(
            f"{path} is not a consolidated checkpoint (.pt from merge_checkpoint.py or "
            f"average_checkpoints.py): {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        ) from exc
    missing = [k for k in KEYS if k not in obj] if isinstance(obj, dict) else list(KEYS)
    if missing:
        raise UserError(
            f"{path} is not a consolidated checkpoint (merge_checkpoint.py / average_checkpoints.py): "
            f"it lacks {', '.join(missing)}"
        )
    obj.setdefault("checkpoint", path)
    if not isinstance(obj["model"], dict) or not all(isinstance(t, torch.Tensor) for t in obj["model"].values()):
        raise UserError(f"{path} is not a consolidated checkpoint: its 'model' is not a dict of tensors")
    for name, tensor in obj["model"].items():
        refuse_non_finite(name, tensor, path)
    return obj


def source_files(paths: Sequence[str]) -> list[tuple[str, str]]:
    """(how to name it to the user, path) of every file merging or averaging `paths` reads — a consolidated file
    itself, a checkpoint folder's meta.json and the files it lists — for refuse_output_over_inputs. A path that
    leads nowhere gives none: the load says why, in its turn."""
    found = []
    for given in paths:
        if os.path.isfile(given):
            found.append((f"the input {given}", given))
            continue
        try:
            folder = resolve(given)
        except UserError:
            continue
        found += [(f"{os.path.basename(f)} of the checkpoint {folder}", f) for f in checkpoint_files(folder)]
    return found


def average(paths: Sequence[str], verify: bool = True) -> dict:
    """The elementwise mean of the fp32 weights of several checkpoints (folders of any layout, or consolidated
    files) of the same model; summed in float64, stored in fp32. Step and config are the last checkpoint's."""
    if not paths:
        raise UserError("no checkpoints to average")
    if len(set(map(os.path.realpath, paths))) != len(paths):
        raise UserError(f"a checkpoint is given twice in {', '.join(paths)}")
    total, first, last, sources = None, None, None, []
    for path in paths:
        state = load(path, verify=verify)
        if first is None:
            first = state
            total = {name: t.double() for name, t in state["model"].items()}
        else:
            check_compatible({"model": state["model_config"]}, ModelConfig(**first["model_config"]), path)
            a, b = first.get("tokenizer_sha256"), state.get("tokenizer_sha256")
            if a and b and a != b:
                raise UserError(
                    f"{path} was trained with another tokenizer than {first['checkpoint']}; "
                    f"only checkpoints of one run (one vocabulary) can be averaged"
                )
            if set(state["model"]) != set(total):
                raise UserError(f"{path} has other parameters than {first['checkpoint']}")
            for name, t in state["model"].items():
                total[name] += t.double()
        sources.append({"checkpoint": state["checkpoint"], "step": state["step"]})
        last = state
    model = {name: (t / len(paths)).float() for name, t in total.items()}
    return {
        "model": model,
        "model_config": last["model_config"],
        "step": last["step"],
        "saved_layout": last.get("saved_layout"),
        "tokenizer_sha256": last.get("tokenizer_sha256"),
        "averaged": sources,
        **({"tokenizer_json": last["tokenizer_json"]} if last.get("tokenizer_json") else {}),
    }


def save(obj: dict, path: str) -> None:
    """obj to path atomically (a staging file renamed into place), in the form its extension names: .safetensors
    (the state dict, the rest as metadata), .bin (the bare state dict, torch.save: what DeepSpeed's zero_to_fp32
    and transformers' pytorch_model.bin hold), anything else the whole dict (torch.save)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(SAFETENSORS):
        safetensors_io.write(obj, path)
        return
    if path.endswith(".bin") and "optimizer" in obj:
        raise UserError(
            f"{path}: a .bin output holds the state dict alone, not the AdamW moments; write a .pt file "
            f"for --with_optimizer"
        )
    with staged_file(path) as tmp:  # a name of its own (a user's PATH.part stays), gone if the save fails
        torch.save(obj["model"] if path.endswith(".bin") else obj, tmp)
