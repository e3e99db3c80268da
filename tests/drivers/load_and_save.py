"""Load a checkpoint into train.py's engine and save it again at once, with no training step in between.

    load_and_save(parse_config(TRAIN_PY_ARGS))    # in a launch: tests/drivers/train_many.py {"load_and_save": ARGS}

The engine is built by train.py's own `Trainer.setup()` (training.trainer); --ckpt_file is loaded through the
trainer's CheckpointManager.resume and written back out as OUTPUT_DIR/checkpoints/step_N by its save. So what a
layout/optimizer loaded — master weights and both AdamW moments, through whatever optimizer DeepSpeed built — can be
compared tensor for tensor with the checkpoint it came from: a lossless load reproduces it exactly.
"""

from __future__ import annotations

import torch.distributed as dist


def load_and_save(config) -> str:
    from training.trainer import Trainer

    trainer = Trainer(config)
    trainer.setup()
    step = trainer.checkpoints.resume(trainer.start)
    path = trainer.checkpoints.save(step, keep=0)
    if dist.get_rank() == 0:
        print(
            f"load_and_save: {config.checkpoint.ckpt_file} -> {path} under "
            f"{type(trainer.engine.ds.optimizer).__name__}",
            flush=True,
        )
    if trainer.lock is not None:
        trainer.lock.release()
    return path
