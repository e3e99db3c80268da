"""The seed's MicroBatchInterleaved example, trained: its MLP on handwritten digits with SGD(lr 1e-2), batch 32,
cross-entropy, tensor-parallel over the launched processes (dp = world / mp) on a DeepSpeed engine.

Each epoch visits the training digits in a seeded random order, in global batches of `batch_size` (the last partial
batch is dropped, as MindSpore's `batch(32)` with drop_remainder); a data-parallel rank takes its contiguous slice.
Every `log_interval` steps rank 0 prints the seed's LossMonitor line, `epoch: E step: S, loss is L` (S counts steps
within the epoch, as LossMonitor does), and every step goes to OUTPUT_DIR/metrics.jsonl. The loss is the batch mean,
the same for every interleave_num. (MindSpore's `MicroBatchInterleaved` returns the *sum* of its parts' mean losses,
which is why the seed's log starts near 2·ln 10 ≈ 4.6; its gradients are then interleave_num times ours.)
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from demos.interleaved_mlp.network import MLPClassifier
from model.config import ConfigError, ParallelConfig, batch_errors
from model.parallel.mappings import gather_from_tp
from model.parallel.topology import ParallelContext, build_grid
from preprocess.digits import load_digits_28x28
from training.run.job import join_job


def layout(world: int, mp: int, interleave_num: int, batch_size: int) -> ParallelConfig:
    parallel = ParallelConfig.for_world(world, model_parallel=mp, interleave_num=interleave_num)
    problems = (
        []
        if parallel.world_size == world
        else [f"model_parallel={mp} does not divide the {world} processes (dp = world / mp)"]
    )
    if mp < 1 or interleave_num < 1:
        problems.append(f"model_parallel={mp} and interleave_num={interleave_num} must be >= 1")
    else:
        problems += batch_errors(parallel, batch_size)
    if problems:
        raise ConfigError("; ".join(problems))
    return parallel


def _global_mean(loss: torch.Tensor, ctx: ParallelContext) -> float:
    loss = loss.detach().clone()
    if ctx.dp_size > 1:
        dist.all_reduce(loss, group=ctx.dp_group)
        loss /= ctx.dp_size
    return float(loss)


@torch.no_grad()
def accuracy(model: MLPClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    logits = gather_from_tp(model(images), model.ctx.tp_group)[:, : model.classes]
    model.train()
    return float((logits.argmax(-1) == labels).float().mean())


def train_digits(args) -> dict:
    import deepspeed

    world = join_job(args.distribute)
    parallel = layout(world, args.mp, args.interleave_num, args.batch_size)
    train, held_out = load_digits_28x28(args.train_size)
    grid = build_grid(parallel)
    ctx = ParallelContext.from_grid(grid)
    model = MLPClassifier(ctx, interleave_num=parallel.interleave_num, seed=args.seed)
    micro = args.batch_size // parallel.data_parallel
    config = {
        "train_batch_size": args.batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr), config=config, mpu=grid
    )
    rank0 = dist.get_rank() == 0
    steps_per_epoch = len(train) // args.batch_size
    total = args.steps or args.epochs * steps_per_epoch
    jsonl = None
    if rank0:
        os.makedirs(args.output_dir, exist_ok=True)
        log = os.path.join(args.output_dir, "metrics.jsonl")
        jsonl = open(log, "w", encoding="utf-8")  # noqa: SIM115 - the run's log, open while it trains
        print(
            f"layout: world={world} dp={parallel.data_parallel} mp={parallel.model_parallel} "
            f"interleave_num={parallel.interleave_num} | {len(train)} training digits, {steps_per_epoch} steps of "
            f"{args.batch_size} per epoch, {total} steps",
            flush=True,
        )
    step, times, losses = 0, [], []
    while step < total:
        epoch = step // steps_per_epoch
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        batch = order[(step % steps_per_epoch) * args.batch_size :][: args.batch_size]
        mine = batch[ctx.dp_rank * micro : (ctx.dp_rank + 1) * micro]
        start = time.perf_counter()
        loss = model.loss(engine(train.images[mine].to(engine.device)), train.labels[mine].to(engine.device))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        step += 1
        losses.append(_global_mean(loss, ctx))
        if rank0:
            jsonl.write(
                json.dumps({"step": step, "epoch": epoch + 1, "loss": losses[-1], "step_time": times[-1]}) + "\n"
            )
            if step % args.log_interval == 0:
                print(f"epoch: {epoch + 1} step: {(step - 1) % steps_per_epoch + 1}, loss is {losses[-1]}", flush=True)
    acc = accuracy(model, held_out.images.to(engine.device), held_out.labels.to(engine.device))
    warm = times[min(len(times) - 1, 5) :]
    summary = {
        "steps": step,
        "final_loss": losses[-1],
        "held_out_accuracy": acc,
        "held_out": len(held_out),
        "mean_step_time_ms": 1000 * sum(warm) / len(warm),
    }
    if rank0:
        jsonl.close()
        print("summary: " + json.dumps(summary), flush=True)
    return summary
