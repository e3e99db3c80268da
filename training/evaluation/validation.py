"""Validation during training: the loss on a held-out TSV, the best checkpoint, early stopping.

`valid_loss` is the mean cross-entropy over every non-PAD target token of the validation set (no dropout, the
training layout's engine: `training.core.step.eval_step` on its global batches, weighted by their token counts), so it
is the same number under every layout. The best checkpoint by validation lives in `checkpoints/best/`, outside the
keep-K rotation; its meta.json holds the validation figures, which is also how a resumed run knows the best so far.
With `--early_stop_patience K` training stops after K validations in a row without improvement.

With `--valid_bleu 1` each validation also translates the validation sources greedily and scores them with
sacreBLEU against the validation targets (cased, detokenized: as run_scripts/evaluate.py). Decoding runs the serial
model on global rank 0 (model/inference.py): the engine's own module where it is the whole model (one stage, one TP
rank, not ZeRO-3-partitioned), else the weights consolidated from a temporary checkpoint of this step
(checkpoints/.valid_bleu, removed afterwards). It draws no random numbers and changes no parameter, so training goes
on exactly as without it; the other ranks wait, and every rank gets the same figure.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from training.checkpoint.folder import BEST
from training.core.data import prepare_data, validation_batches
from training.core.step import eval_step


class Validator:
    """`bleu`: a callable step → a consolidated serial checkpoint folder (written collectively by every rank), used
    when the engine's module is not the whole serial model; None: no BLEU."""

    def __init__(
        self,
        valid_file: str,
        tokenizer_path: str,
        src_len: int,
        tgt_len: int,
        global_batch: int,
        ctx,
        micro_batch_num: int,
        device,
        progress: bool,
        bleu=None,
        cache_dir=None,
        corpus=None,
    ):
        self.data = prepare_data(
            valid_file,
            tokenizer_path,
            src_len,
            tgt_len,
            progress=progress,
            flag="--valid_file",
            cache_dir=cache_dir,
            corpus=corpus,
        )
        self.global_batch, self.ctx, self.micro, self.device = global_batch, ctx, micro_batch_num, device
        self.tokenizer_path, self.save_for_bleu = str(tokenizer_path), bleu
        self.references = None
        if bleu is not None:
            from preprocess.corpus_source import read_pairs

            self.sources, self.references = read_pairs(valid_file, corpus, "--valid_file")

    def evaluate(self, engine, step: int = 0) -> dict:
        """{"valid_loss": ...[, "valid_bleu": ...]}, identical on every rank. Collective: every rank calls it."""
        total, tokens = 0.0, 0
        for batches in validation_batches(
            self.data, self.global_batch, self.ctx.dp_rank, self.ctx.dp_size, self.micro, self.device
        ):
            if batches.global_tokens:
                total += eval_step(engine, batches) * batches.global_tokens
                tokens += batches.global_tokens
        figures = {"valid_loss": total / max(tokens, 1)}
        if self.references is not None:
            figures["valid_bleu"] = self._bleu(engine, step)
        return figures

    def _bleu(self, engine, step: int) -> float:
        from model.transformer import Seq2SeqTransformer

        whole = isinstance(engine.module, Seq2SeqTransformer) and engine.ctx.tp_size == 1 and engine.zero_stage < 3
        folder = None if whole else self.save_for_bleu(step)  # collective: every rank writes its shards
        score = torch.zeros((), dtype=torch.float64, device=engine.device)
        if dist.get_rank() == 0:
            score.fill_(self._translate_and_score(engine.module if whole else None, folder))
        if folder is not None and dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
        if dist.get_world_size() > 1:
            dist.broadcast(score, src=0)
        return float(score)

    def _translate_and_score(self, model, folder) -> float:
        import sacrebleu

        from preprocess.tokenizer import load_tokenizer
        from training.evaluation.translator import Translator

        if model is None:
            translator = Translator.load(folder, self.tokenizer_path, device=str(self.device))
        else:
            translator = Translator(
                model,
                load_tokenizer(self.tokenizer_path),
                self.tokenizer_path,
                {"step": None, "checkpoint": "(training)"},
            )
        hypotheses = translator.translate(self.sources).hypotheses
        return float(sacrebleu.corpus_bleu(hypotheses, [self.references]).score)


class BestTracker:
    """The best validation so far (lower valid_loss is better) and how many validations ago it was."""

    def __init__(self, ckpt_root: str, patience: int, resumed_at: int | None = None, interval: int = 1):
        """`resumed_at`: the step a resumed run continues from (None: a fresh start)."""
        self.patience, self.best, self.since_best = patience, None, 0
        meta = os.path.join(ckpt_root, BEST, "meta.json")
        if resumed_at is not None and os.path.isfile(meta):  # a resumed run continues the same competition
            with open(meta, encoding="utf-8") as f:
                self.best = json.load(f).get("validation")
            if self.best:
                self.since_best = max(0, (resumed_at - self.best["step"]) // max(interval, 1))

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

    def summary(self) -> dict | None:
        return self.best
