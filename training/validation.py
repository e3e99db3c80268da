"""Validation during training: the loss on a held-out TSV, the best checkpoint, early stopping.

`valid_loss` is the mean cross-entropy over every non-PAD target token of the validation set (no dropout, the
training layout's engine: `training.loop.eval_step` on its global batches, weighted by their token counts), so it
is the same number under every layout. The best checkpoint by validation lives in `checkpoints/best/`, outside the
keep-K rotation; its meta.json holds the validation figures, which is also how a resumed run knows the best so far.
With `--early_stop_patience K` training stops after K validations in a row without improvement.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from training.data import prepare_data, validation_batches
from training.loop import eval_step

BEST = "best"


class Validator:
    def __init__(self, valid_file: str, tokenizer_path: str, src_len: int, tgt_len: int, global_batch: int,
                 ctx, micro_batch_num: int, device, progress: bool):
        self.data = prepare_data(valid_file, tokenizer_path, src_len, tgt_len, progress=progress,
                                 flag="--valid_file")
        self.global_batch, self.ctx, self.micro, self.device = global_batch, ctx, micro_batch_num, device

    def evaluate(self, engine) -> dict:
        """{"valid_loss": ...}, identical on every rank. Collective: every rank calls it."""
        total, tokens = 0.0, 0
        for batches in validation_batches(self.data, self.global_batch, self.ctx.dp_rank, self.ctx.dp_size,
                                          self.micro, self.device):
            if batches.global_tokens:
                total += eval_step(engine, batches) * batches.global_tokens
                tokens += batches.global_tokens
        return {"valid_loss": total / max(tokens, 1)}


class BestTracker:
    """The best validation so far (lower valid_loss is better) and how many validations ago it was."""

    def __init__(self, ckpt_root: str, patience: int, start_step: int = 0, interval: int = 1):
        self.patience, self.best, self.since_best = patience, None, 0
        meta = os.path.join(ckpt_root, BEST, "meta.json")
        if start_step and os.path.isfile(meta):            # a resumed run continues the same competition
            with open(meta, encoding="utf-8") as f:
                self.best = json.load(f).get("validation")
            if self.best:
                self.since_best = max(0, (start_step - self.best["step"]) // max(interval, 1))

    def update(self, step: int, figures: dict) -> bool:
        """Record a validation; True when it is the best so far."""
        if self.best is None or figures["valid_loss"] < self.best["valid_loss"]:
            self.best, self.since_best = {"step": step, **figures}, 0
            return True
        self.since_best += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.since_best >= self.patience

    def summary(self) -> Optional[dict]:
        return self.best
