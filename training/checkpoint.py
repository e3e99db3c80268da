"""Checkpoint save / resume (placeholder wiring; the checkpoint issue fills this module in)."""
from __future__ import annotations

from preprocess.errors import UserError


def maybe_resume(engine, args, model_cfg, parallel, data) -> int:
    if args.resume or args.ckpt_file:
        raise UserError("checkpoint resume is not available yet in this version")
    return 0


def maybe_save(engine, args, step, model_cfg, parallel, data) -> None:
    if args.save_checkpoint_steps:
        raise UserError("checkpoint saving is not available yet in this version")
