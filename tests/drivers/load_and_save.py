"""Load a checkpoint into train.py's engine and save it again at once, with no training step in between.

    load_and_save(parse_args(TRAIN_PY_ARGS))    # in a launch: tests/drivers/train_many.py {"load_and_save": ARGS}

The engine is built exactly as training.run.run_training builds it (the same functions, in the same order, with the
same arguments); --ckpt_file is loaded through training.checkpoint.maybe_resume and written back out as
OUTPUT_DIR/checkpoints/step_N by training.checkpoint.save. So what a layout/optimizer loaded — master weights and
both AdamW moments, through whatever optimizer DeepSpeed built — can be compared tensor for tensor with the
checkpoint it came from: a lossless load reproduces it exactly.
"""
from __future__ import annotations

import torch.distributed as dist


def load_and_save(args) -> str:
    from model.config import validate_layout
    from training import checkpoint as ckpt
    from training.args import model_config, parallel_config
    from training.data import prepare_data
    from training.engine import build_engine, check_options, init_distributed
    from training.schedule import lr_factor

    world = init_distributed(args.distribute)
    parallel = parallel_config(args, world)
    probe = model_config(args, vocab_size=max(args.vocab_size or 1, 1), pad_id=0)
    validate_layout(parallel, probe, world_size=world, global_batch=args.batch_size)
    check_options(args.precision, args.clip_grad)
    data = prepare_data(args.file_path, args.tokenizer, args.src_len, args.tgt_len, args.tokenizer_vocab_size,
                        progress=False)
    model_cfg = model_config(args, vocab_size=args.vocab_size or data.vocab_size, pad_id=data.pad_id)
    total_steps = args.steps if args.steps is not None else args.epochs * (data.num_samples // args.batch_size)
    schedule = lr_factor(args.lr_schedule, args.warmup_steps, total_steps, args.min_lr_ratio, args.lr_power)
    engine = build_engine(model_cfg, parallel, world_size=world, global_batch=args.batch_size, seed=args.seed,
                          lr=args.lr, weight_decay=args.weight_decay, lr_schedule=schedule,
                          clip_grad=args.clip_grad, precision=args.precision, pipeline_func=args.pipeline_func,
                          ds_overrides=args.deepspeed_overrides, ds_config_file=args.deepspeed_config)
    ckpt.check_optimizer(engine, args)
    step = ckpt.maybe_resume(engine, args, model_cfg, parallel, data)
    path = ckpt.save(engine, args.output_dir, step, model_cfg, parallel, args, data.tokenizer_path, 0)
    if dist.get_rank() == 0:
        print(f"load_and_save: {args.ckpt_file} -> {path} under {type(engine.ds.optimizer).__name__}", flush=True)
    return path
