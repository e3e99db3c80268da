"""One optimizer step for either engine kind, and the step loop that train.py runs."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from training.data import StepBatches
from training.engine import Engine


def train_step(engine: Engine, batches: StepBatches) -> float:
    """Forward/backward over this rank's micro-batches and one optimizer step; returns the global-batch loss
    (mean over all non-PAD target tokens of the global batch), identical on every rank."""
    ds = engine.ds
    if engine.pipelined:
        return float(ds.train_batch(data_iter=iter(batches)))
    ds.train()
    total = torch.zeros((), dtype=torch.float64)
    for inputs, target in batches:
        logits = ds(*inputs)
        loss = ds.module.loss_fn(logits, target)
        ds.backward(loss)
        ds.step()
        total += loss.detach().double().cpu()
    return _dp_mean(total / engine.parallel.micro_batch_num, engine)


def eval_step(engine: Engine, batches: StepBatches) -> float:
    """The same loss without gradients or an optimizer step."""
    ds = engine.ds
    if engine.pipelined:
        return float(ds.eval_batch(data_iter=iter(batches)))
    ds.eval()                                              # no dropout while evaluating
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for inputs, target in batches:
            total += ds.module.loss_fn(ds(*inputs), target).double().cpu()
    return _dp_mean(total / engine.parallel.micro_batch_num, engine)


def _dp_mean(value: torch.Tensor, engine: Engine) -> float:
    if engine.ctx.dp_size > 1:
        t = value.to(torch.float64)
        dist.all_reduce(t, group=engine.ctx.dp_group)
        value = t / engine.ctx.dp_size
    return float(value)


def current_lr(engine: Engine) -> float:
    return float(engine.ds.optimizer.param_groups[0]["lr"]) if hasattr(engine.ds.optimizer, "param_groups") \
        else float(engine.ds.get_lr()[0])


class StepTimer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
