"""What a checkpoint carries of the run's settings, and a run that starts from it taking them.

A checkpoint carries the model's shape, its tokenizer, the data order and the whole optimisation trajectory: the
learning rate and its schedule (warmup, decay horizon, floor, power), clipping, weight decay and AdamW's betas and
epsilon, label smoothing, and the run's planned length. A run that starts from it (training.run.start_point decides
which) takes each of them unless the user set the flag (command line or recipe); a flag that differs from the
checkpoint is announced, and a size that would stop the weights from loading is refused, naming the flag.

    cfg, lines = take_settings(cfg, start)   # the checkpoint's settings for every flag the user left out
"""

from __future__ import annotations

import json
import os

from common.errors import UserError
from common.hashing import file_sha256
from training.checkpoint.format import SHAPE_FIELDS, recorded_tokenizer
from training.config.schema import FIXED_ORDER, SHAPE, TOKEN_ORDER, TRAJECTORY
from training.config.sections import TrainConfig, carried

# what a checkpoint carries, as the settings declare it (training.config.sections): flag dest → meta.json "model"
# field (sizes must match for the weights to load, the rest may change); the data order's settings by batching; the
# trajectory in meta.json "optimization" (decay_steps and steps saved as resolved step counts)
MODEL_FLAGS = carried(SHAPE)
DATA_ORDER_FLAGS = {batching: tuple(carried(batching)) for batching in (FIXED_ORDER, TOKEN_ORDER)}
TRAJECTORY_FLAGS = tuple(carried(TRAJECTORY))


def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def _model_settings(meta: dict, flags, explicit: dict, path: str, taken: list, overridden: list) -> None:
    saved = meta["model"]
    want = {dest: saved[field] for dest, field in MODEL_FLAGS.items() if field in saved}
    if "attention_dropout" in want and "dropout" in explicit and "attention_dropout" not in explicit:
        del want["attention_dropout"]  # it defaults to --dropout, which the user set
    for dest, value in want.items():
        if dest not in explicit:
            setattr(flags, dest, value)
            taken.append(f"{dest}={_show(value)}")
            continue
        given = getattr(flags, dest)
        same = (
            (given or flags.d_model) == (value or saved["d_model"])
            if dest == "ffn_size"  # 0: d_model
            else given == value
        )
        if same:
            continue
        if MODEL_FLAGS[dest] in SHAPE_FIELDS or dest == "ffn_size":  # (SHAPE_FIELDS names the effective "ffn")
            raise UserError(
                f"{explicit[dest]} {_show(given)} conflicts with checkpoint {path}, whose weights have "
                f"{dest}={_show(value)}: they cannot load into another shape. Leave {explicit[dest]} out "
                f"to continue with the checkpoint's (the layout, dropout and schedule may change)"
            )
        overridden.append(f"{dest}={_show(given)} (checkpoint {_show(value)})")


def _tokenizer(meta: dict, flags, explicit: dict, path: str, taken: list) -> None:
    if "tokenizer" not in explicit:
        tokenizer = recorded_tokenizer(path, meta)  # a missing or changed copy asks for --tokenizer: see below
        if tokenizer is not None:
            flags.tokenizer = tokenizer
            taken.append(f"tokenizer={tokenizer}")
        return
    # the user's tokenizer, whatever became of the copy: it must be the one the weights were trained with
    if (
        meta.get("tokenizer_sha256")
        and os.path.isfile(flags.tokenizer)
        and file_sha256(flags.tokenizer) != meta["tokenizer_sha256"]
    ):
        raise UserError(
            f"{explicit['tokenizer']} {flags.tokenizer} is not the tokenizer checkpoint {path} was "
            f"trained with (sha256 differs): its token ids would not match the weights. Leave it out "
            f"to use the checkpoint's own copy ({meta.get('tokenizer')} in it), or give that run's "
            f"tokenizer file"
        )


def _data_order(meta: dict, flags, explicit: dict, taken: list) -> None:
    order = meta.get("data_order")
    if not (isinstance(order, dict) and order.get("batching") in DATA_ORDER_FLAGS):
        return
    if order["batching"] == "fixed" and "max_tokens" not in explicit:
        flags.max_tokens = 0  # fixed batches: no token batching
    if order["batching"] == "tokens":
        order = {"num_batch_buckets": 0, **order}  # not recorded when 0
    for dest in DATA_ORDER_FLAGS[order["batching"]]:
        if dest in order and dest not in explicit:
            setattr(flags, dest, order[dest])
            taken.append(f"{dest}={order[dest]}")


def _trajectory(meta: dict, flags, explicit: dict, path: str, taken: list, overridden: list) -> list[str]:
    """The optimisation settings; returns notes (a checkpoint saved before they were recorded, a run that goes past
    its schedule's end)."""
    saved = meta.get("optimization")
    if not isinstance(saved, dict):
        return [
            f"checkpoint {path} does not record its learning-rate schedule and optimizer settings (saved by an "
            f"older version): this run uses the flags' values for them"
        ]
    for dest in TRAJECTORY_FLAGS:
        if dest not in saved:
            continue
        value = saved[dest]
        if dest == "steps" and "epochs" in explicit and "steps" not in explicit:
            continue  # --epochs given: its length, not the checkpoint's
        if dest not in explicit:
            setattr(flags, dest, value)
            taken.append(f"{dest}={_show(value)}")
        elif dest != "steps" and getattr(flags, dest) != value:  # (more --steps: the usual way to go on)
            overridden.append(f"{dest}={_show(getattr(flags, dest))} (checkpoint {_show(value)})")
    notes = []
    decays = flags.lr_schedule in ("cosine", "polynomial")
    if decays and flags.steps is not None and flags.decay_steps is not None and flags.steps > flags.decay_steps:
        notes.append(
            f"the {flags.lr_schedule} schedule ends at step {flags.decay_steps}: steps "
            f"{flags.decay_steps + 1}-{flags.steps} train at its final rate (--min_lr_ratio "
            f"{flags.min_lr_ratio:g} × --lr); give --decay_steps {flags.steps} to stretch it instead"
        )
    return notes


def take_settings(cfg: TrainConfig, start) -> tuple[TrainConfig, list[str]]:
    """`cfg` with the checkpoint's settings for every flag the user did not set, and the lines to report (none for
    a fresh start). `start`: training.run.start_point.StartPoint, the same on every rank."""
    if start.fresh:
        return cfg, []
    flags, explicit, path, meta = cfg.to_flags(), cfg.explicit, start.path, start.meta
    taken, overridden = [], []
    _model_settings(meta, flags, explicit, path, taken, overridden)
    _tokenizer(meta, flags, explicit, path, taken)
    _data_order(meta, flags, explicit, taken)
    notes = _trajectory(meta, flags, explicit, path, taken, overridden)
    lines = [
        f"starting from checkpoint {path} ({start.how}): its settings "
        + (" ".join(taken) if taken else "(none needed)")
    ]
    if overridden:
        lines.append("overridden by flags: " + " ".join(overridden))
    return TrainConfig.from_flags(flags), lines + notes


def trajectory(cfg: TrainConfig, total_steps: int) -> dict:
    """What a checkpoint records of the optimisation (meta.json "optimization"), the horizon and length resolved."""
    opt = cfg.optimization
    values = {dest: getattr(opt, dest) for dest in TRAJECTORY_FLAGS}
    values.update(decay_steps=opt.horizon(total_steps), steps=total_steps)
    return values
