"""One optimizer step for either engine kind, and what the step loop reads back from the engine."""

from __future__ import annotations

import time

import torch

from training.core.data import StepBatches
from training.core.engine import Engine


def train_step(engine: Engine, batches: StepBatches) -> float:
    """Forward/backward over this rank's micro-batches and one optimizer step; returns the global-batch loss
    (`training.core.objective`), identical on every rank."""
    ds = engine.ds
    samples = ds.global_samples
    engine.objective.begin_step(batches.global_tokens)
    if engine.pipelined:
        engine.expect_shape(batches.micro_shape)
        engine.module.expect_packings(batches.packings())  # model.pipeline: no nonzero() on any stage
        loss = float(ds.train_batch(data_iter=iter(batches)))
    else:
        ds.train()
        micro_losses = []
        for inputs, labels in batches:
            micro_loss = ds.module.loss_fn(ds(*inputs), labels)
            ds.backward(micro_loss)
            ds.step()
            micro_losses.append(micro_loss.detach())
        loss = engine.objective.reported(micro_losses, engine.ctx.dp_group)
    # DeepSpeed adds its configured train_batch_size; token batches vary, so count the pairs this step trained on
    # (checkpoints store it as samples_seen)
    ds.global_samples = samples + batches.pairs
    return loss


def eval_step(engine: Engine, batches: StepBatches) -> float:
    """The same loss without gradients or an optimizer step."""
    ds = engine.ds
    engine.objective.begin_step(batches.global_tokens)
    if engine.pipelined:
        engine.expect_shape(batches.micro_shape)
        engine.module.expect_packings(batches.packings())  # model.pipeline: no nonzero() on any stage
        return float(ds.eval_batch(data_iter=iter(batches)))
    ds.eval()  # no dropout while evaluating
    with torch.no_grad():
        micro_losses = [ds.module.loss_fn(ds(*inputs), labels) for inputs, labels in batches]
    return engine.objective.reported(micro_losses, engine.ctx.dp_group)


def current_lr(engine: Engine) -> float:
    return float(engine.ds.get_lr()[0])


class StepTimer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
