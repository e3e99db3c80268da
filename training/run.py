"""train.py's body: data → engine → step loop → metrics (checkpoints hook in at the marked places)."""
from __future__ import annotations

import os

import torch.distributed as dist

from model.config import validate_layout
from preprocess.errors import UserError
from training.args import model_config, parallel_config
from training.data import BatchFeeder, batch_schedule, prepare_data
from training.engine import build_engine, check_options, device, init_distributed
from training.loop import StepTimer, current_lr, eval_step, train_step
from training.metrics import MetricsWriter
from training.nonfinite import NonFiniteSteps
from training.output_dir import claim_output_dir
from training.rank_failures import check_failure_flags
from training.schedule import lr_factor
from training.speed import SpeedMeter
from training.validation import BEST, BestTracker, Validator


def batch_unit_of(args) -> tuple[int, str]:
    """What the layout must divide: the global batch_size, or with token batches the batch_multiple every batch's
    size is a multiple of (also the batch DeepSpeed's config counts)."""
    return (args.batch_multiple, "batch_multiple") if args.max_tokens else (args.batch_size, "batch_size")


def valid_batch_size(args) -> int:
    """Validation runs fixed batches; with token batches, batch_size rounded to a multiple of batch_multiple."""
    if not args.max_tokens:
        return args.batch_size
    return max(args.batch_multiple, args.batch_size // args.batch_multiple * args.batch_multiple)


def run_training(args) -> int:
    check_failure_flags(args)
    lock = claim_output_dir(args)        # rank 0: the folder, its lock and the start point, before any work
    world = init_distributed(args.distribute, args.comm_timeout)
    rank = dist.get_rank()
    parallel = parallel_config(args, world)
    # Check the layout before touching data (cheap, and the error is the one users need first).
    probe = model_config(args, vocab_size=max(args.vocab_size or 1, 1), pad_id=0)
    batch_unit, batch_name = batch_unit_of(args)
    validate_layout(parallel, probe, world_size=world, global_batch=batch_unit, batch_name=batch_name)
    check_options(args.precision, args.clip_grad)

    data = prepare_data(args.file_path, args.tokenizer, args.src_len, args.tgt_len, args.tokenizer_vocab_size,
                        progress=rank == 0)
    vocab = args.vocab_size or data.vocab_size
    if vocab < data.vocab_size:
        raise UserError(f"--vocab_size {vocab} is smaller than the tokenizer's vocabulary ({data.vocab_size}); "
                        f"use --vocab_size {data.vocab_size} or more, or leave it out")
    if not args.max_tokens and args.batch_size > data.num_samples:
        raise UserError(f"--batch_size {args.batch_size} is larger than the dataset ({data.num_samples} pairs)")
    model_cfg = model_config(args, vocab_size=vocab, pad_id=data.pad_id)
    batches = batch_schedule(data, args.batch_size, args.seed, args.max_tokens, args.batch_multiple,
                             args.pad_multiple)
    total_steps = args.steps if args.steps is not None else args.epochs * batches.batches_per_epoch
    schedule = lr_factor(args.lr_schedule, args.warmup_steps, total_steps, args.min_lr_ratio, args.lr_power)

    engine = build_engine(model_cfg, parallel, world_size=world, global_batch=batch_unit, seed=args.seed,
                          lr=args.lr, weight_decay=args.weight_decay, lr_schedule=schedule,
                          clip_grad=args.clip_grad, precision=args.precision, pipeline_func=args.pipeline_func,
                          ds_overrides=args.deepspeed_overrides, ds_config_file=args.deepspeed_config,
                          dynamic_shapes=bool(args.max_tokens), batch_name=batch_name)
    feeder = BatchFeeder(data, batches, engine.ctx.dp_rank, engine.ctx.dp_size, parallel.micro_batch_num, device())

    from training import checkpoint as ckpt
    ckpt.check_optimizer(engine, args)
    start_step = ckpt.maybe_resume(engine, args, model_cfg, parallel, data)

    validator = tracker = None
    if args.valid_file and args.train:
        def save_for_bleu(step):                        # the whole model for decoding, from any layout
            return ckpt.save(engine, args.output_dir, step, model_cfg, parallel, args, data.tokenizer_path, 0,
                             name=".valid_bleu")
        validator = Validator(args.valid_file, str(data.tokenizer_path), args.src_len, args.tgt_len,
                              valid_batch_size(args), engine.ctx, parallel.micro_batch_num, device(), progress=rank == 0,
                              bleu=save_for_bleu if args.valid_bleu else None)
        valid_every = args.valid_interval or feeder.schedule.batches_per_epoch
        tracker = BestTracker(ckpt.checkpoints_dir(args.output_dir), args.early_stop_patience, start_step,
                              valid_every)

    writer = MetricsWriter(args.output_dir, enabled=rank == 0, total_steps=total_steps, start_step=start_step,
                           log_interval=args.log_interval, tensorboard=args.tensorboard)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())   # ZeRO-3: full size
    info = engine.describe()
    writer.run_info({**info, "vocab": vocab, "params_rank0": n_params, "start_step": start_step,
                     "total_steps": total_steps})
    writer.message(" ".join(["layout:"] + [f"{k}={info[k]}" for k in ("world", "dp", "mp", "pp", "micro_batch_num",
                                                                            "interleave_num")]
                            + [f"zero={info['zero_stage']}", f"recompute={info['recompute']}",
                               f"precision={info['precision']}", f"optimizer={info['optimizer']}",
                               f"grad_accum={info['grad_accum_dtype']}", f"backend={info['backend']}",
                               f"device={info['device']}"])
                   + f" | vocab={vocab} params on rank 0={n_params:,} | steps {start_step}→{total_steps}")
    if start_step >= total_steps:
        writer.message(f"nothing to train: the checkpoint is at step {start_step} and --steps is {total_steps}; "
                       f"raise --steps to continue")
    speed = SpeedMeter(model_cfg, world, args.precision, device())
    step_fn = train_step if args.train else eval_step
    nonfinite = NonFiniteSteps(engine, args.nan_policy, args.nan_skip_limit, args.lr,
                               lambda: ckpt.latest_checkpoint(ckpt.checkpoints_dir(args.output_dir)))
    losses = []
    for step in range(start_step, total_steps):
        batches = feeder.step(step)
        lr = current_lr(engine)                          # the rate this step uses (the scheduler moves after it)
        with StepTimer() as t:
            loss = step_fn(engine, batches)
        losses.append(loss)
        record = {"step": step + 1, "epoch": feeder.epoch_of(step), "loss": loss, "lr": lr}
        if args.train:
            record["grad_norm"] = engine.grad_norm()
            if engine.precision == "fp16":
                record.update(loss_scale=engine.loss_scale(), skipped_steps=engine.ds.skipped_steps)
        record.update(pairs=batches.pairs, tokens=batches.global_tokens,
                      tokens_per_sec=batches.global_tokens / max(t.seconds, 1e-9), step_time=t.seconds,
                      padding=round(batches.padding, 4),
                      **speed.figures(batches.src_tokens, batches.global_tokens, batches.pairs, batches.lengths,
                                      t.seconds))
        stop = nonfinite.after_step(step + 1, loss, record) if args.train else None
        if stop:                               # logged (loss null), then ended before validating or saving
            writer.log(record)
            writer.close()
            raise UserError(stop)
        improved = False
        if validator is not None and ((step + 1) % valid_every == 0 or step + 1 == total_steps):
            figures = validator.evaluate(engine, step + 1)
            improved = tracker.update(step + 1, figures)
            record.update(figures, best_valid_loss=tracker.best["valid_loss"], best_step=tracker.best["step"])
        writer.log(record)
        early_stop = tracker is not None and tracker.should_stop
        if args.train:
            ckpt.maybe_save(engine, args, step + 1, model_cfg, parallel, data,
                            last=step + 1 == total_steps or early_stop)
        if improved:
            ckpt.save(engine, args.output_dir, step + 1, model_cfg, parallel, args, data.tokenizer_path, 0,
                      name=BEST, validation=tracker.best)
        if early_stop:
            writer.message(f"early stop after step {step + 1}: valid_loss has not improved for "
                           f"{tracker.since_best} validations (best {tracker.best['valid_loss']:.4f} at step "
                           f"{tracker.best['step']}, kept in {ckpt.checkpoints_dir(args.output_dir)}/{BEST})")
            break
    summary = {"steps": start_step + len(losses), "final_loss": losses[-1] if losses else None,
               "output_dir": os.path.abspath(args.output_dir)}
    if tracker is not None:
        summary["best_validation"] = tracker.best
    # what this rank's optimizer holds now, next to the run's description (plan.py predicts it: tests/test_parity.py)
    writer.run_info({**info, "vocab": vocab, "params_rank0": n_params, "start_step": start_step,
                     "total_steps": total_steps, "optimizer_state_bytes_rank0": engine.optimizer_state_bytes()})
    writer.close(summary)
    if lock is not None:
        lock.release()
    return 0
