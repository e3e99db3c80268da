"""Which checkpoint a decoding command's --ckpt_file means, and why — `RUN/best`, `RUN/latest`, a run's output_dir
or checkpoints/ folder (→ latest), a step folder, a consolidated .pt — so the command can say what it chose.

`best` is the run's validation record: the trainer keeps the checkpoint of its lowest valid_loss in
checkpoints/best (outside the rotation) with that validation in its meta.json.
"""

from __future__ import annotations

import json
import os

from common.errors import UserError
from training.checkpoint import latest_pointer
from training.checkpoint.folder import BEST, checkpoints_dir, latest_checkpoint, resolve

NAMES = (BEST, latest_pointer.NAME)


def _roots(run: str) -> list[str]:
    """The checkpoints/ folders `run` may mean: itself or its checkpoints/ sub-folder."""
    return [r for r in (run, checkpoints_dir(run)) if os.path.isdir(r)]


def _best_reason(path: str) -> str:
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            validation = json.load(f).get("validation") or {}
    except (OSError, ValueError):
        validation = {}
    if "valid_loss" not in validation:
        return "best: the run's best validation checkpoint"
    bleu = f", BLEU {validation['valid_bleu']:.2f}" if isinstance(validation.get("valid_bleu"), (int, float)) else ""
    return f"best: the lowest valid_loss of the run's validations, {validation['valid_loss']:.4f}{bleu}"


def choose(ckpt: str) -> tuple[str, str]:
    """(the path to load, why it was chosen: '' for a path that names one checkpoint itself)."""
    name = os.path.basename(os.path.normpath(ckpt))
    if name == latest_pointer.NAME and os.path.isfile(ckpt):  # the pointer itself (RUN/checkpoints/latest)
        root = os.path.dirname(os.path.abspath(ckpt))
        return latest_checkpoint(root), f"latest: the newest complete checkpoint of {os.path.dirname(ckpt) or '.'}"
    if not os.path.exists(ckpt) and name in NAMES:
        run = os.path.dirname(os.path.normpath(ckpt)) or "."
        if not os.path.isdir(run):
            raise UserError(f"--ckpt_file {ckpt}: {run} is not a folder (give RUN/{name}, RUN a run's output_dir)")
        for root in _roots(run):
            if name == BEST and os.path.isfile(os.path.join(root, BEST, "meta.json")):
                return os.path.join(root, BEST), _best_reason(os.path.join(root, BEST))
            found = latest_checkpoint(root) if name == latest_pointer.NAME else None
            if found:
                return found, f"latest: the newest complete checkpoint of {run}"
        if name == BEST:
            raise UserError(
                f"--ckpt_file {ckpt}: {run} holds no best checkpoint (checkpoints/best is kept by a run "
                f"that validates: train with --valid_file); use "
                f"{os.path.join(run, latest_pointer.NAME)} or a step_* folder"
            )
        raise UserError(f"--ckpt_file {ckpt}: {run} holds no complete checkpoint (no checkpoints/latest)")
    if os.path.isfile(ckpt):
        return ckpt, ""
    path = resolve(ckpt)  # a step folder, or a run / checkpoints folder → its latest
    if os.path.normpath(path) != os.path.normpath(ckpt):
        return path, f"latest: the newest complete checkpoint of {ckpt}"
    if name == BEST:
        return path, _best_reason(path)
    return path, ""
