"""The checks train.py makes on its settings before it starts a process group, reads data or builds a model — one
function, so that `plan.py --check` (the launch scripts run it before any rank starts) refuses exactly what train.py
would refuse, in a second instead of after the launch.

`check_run(config, world_size)`: the layout rules (`model.config.validate_layout`, with the batch the run really
cuts: the global batch, or with token batches their batch_multiple), the pipeline_func (it must import), and the
DeepSpeed settings a recipe's "deepspeed" section or --deepspeed_config adds (training.core.engine.deepspeed_config
refuses, e.g., a ZeRO stage set there instead of with --zero_stage). What needs the machine (the accelerator's
precisions) or the data (the tokenizer's vocabulary, the dataset's size) is checked by the trainer itself.
"""

from __future__ import annotations

from model.config import ModelConfig, ParallelConfig, validate_layout
from model.placement import load_pipeline_func
from training.config.sections import TrainConfig


def check_run(cfg: TrainConfig, world_size: int) -> tuple[ModelConfig, ParallelConfig]:
    """(the model's shape before the tokenizer is known, the layout at this world size), or UserError naming what
    is wrong and what would fit."""
    parallel = cfg.parallel.parallel_config(world_size)
    model = cfg.model.probe()
    batch_unit, batch_name = cfg.data.batch_unit
    validate_layout(parallel, model, world_size=world_size, global_batch=batch_unit, batch_name=batch_name)
    load_pipeline_func(cfg.parallel.pipeline_func)
    if cfg.parallel.deepspeed_overrides or cfg.parallel.deepspeed_config:
        # only what the user adds can contradict the generated config (importing DeepSpeed costs seconds: not
        # without need)
        from training.core.engine import deepspeed_config

        deepspeed_config(
            parallel,
            batch_unit,
            cfg.parallel.precision,
            cfg.optimization.clip_grad,
            2,
            cfg.parallel.deepspeed_overrides,
            cfg.parallel.deepspeed_config,
        )
    return model, parallel
