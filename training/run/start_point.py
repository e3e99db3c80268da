"""Where a run starts — fresh, `--resume` (the folder's latest), `--resume auto`, `--resume PATH`, or `--ckpt_file`
onto another layout — decided once, by global rank 0, and handed with the settings it carries to every rank.

    start = agree(cfg.checkpoint)            # every rank, once the process group exists
    cfg, lines = take_settings(cfg, start)   # the checkpoint's settings for every flag the user left out

Rank 0 decides under the output folder's lock (training.run.output_lock): which checkpoint the flags name
(training.checkpoint.resume.resume_source; with --resume auto the newest whose checksums verify — every rank hashing
its share of each candidate, training.checkpoint.spread_verify), whether starting
there would mix two runs in one folder (check_start_point), and reads its meta.json. One broadcast gives every rank
the same answer — or the same one-line refusal.

A checkpoint carries the model's shape, its tokenizer, the data order and the whole optimisation trajectory: the
learning rate and its schedule (warmup, decay horizon, floor, power), clipping, weight decay and AdamW's betas and
epsilon, label smoothing, and the run's planned length. A run that starts from it takes each of them unless the user
set the flag (command line or recipe); a flag that differs from the checkpoint is announced, and a size that would
stop the weights from loading is refused, naming the flag.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from common.errors import UserError
from common.hashing import file_sha256
from training.checkpoint.folder import checkpoints_dir
from training.checkpoint.format import SHAPE_FIELDS, check_headers, read_meta, recorded_tokenizer
from training.checkpoint.resume import AUTO, check_start_point, resume_source
from training.checkpoint.spread_verify import newest_intact_spread
from training.config.schema import FIXED_ORDER, SHAPE, TOKEN_ORDER, TRAJECTORY
from training.config.sections import CheckpointSection, TrainConfig, carried

# what a checkpoint carries, as the settings declare it (training.config.sections): flag dest → meta.json "model"
# field (sizes must match for the weights to load, the rest may change); the data order's settings by batching; the
# trajectory in meta.json "optimization" (decay_steps and steps saved as resolved step counts)
MODEL_FLAGS = carried(SHAPE)
DATA_ORDER_FLAGS = {batching: tuple(carried(batching)) for batching in (FIXED_ORDER, TOKEN_ORDER)}
TRAJECTORY_FLAGS = tuple(carried(TRAJECTORY))


@dataclass(frozen=True)
class StartPoint:
    path: str | None = None        # the checkpoint folder; None: a fresh start
    how: str = "fresh"                # the flag that chose it
    verified: bool = False            # every file already checked against its sha256 by the job (--resume auto)
    meta: dict | None = None       # its meta.json

    @property
    def fresh(self) -> bool:
        return self.path is None


def _how(section: CheckpointSection, path: str | None) -> str:
    if path is None:
        return "fresh"
    if section.resume not in (None, AUTO, "latest"):
        return f"--resume {section.resume}"
    if section.resume is not None and os.path.dirname(os.path.realpath(path)) == os.path.realpath(
            os.path.join(section.output_dir, "checkpoints")):
        return "--resume auto" if section.resume == AUTO else "--resume"
    return "--ckpt_file"


def decide(section: CheckpointSection, report: Callable[[str], None] = print,
           intact: tuple | None = None) -> StartPoint:
    """Rank 0's decision (under the output folder's lock); UserError when the flags name no usable start.
    `intact`: --resume auto's candidates already verified (newest_intact_spread)."""
    verify = section.resume == AUTO and section.verify
    path = resume_source(section, verify=verify, report=report, intact=intact)
    check_start_point(section, path)
    if path is None:
        return StartPoint()
    how = _how(section, path)
    meta = read_meta(path)
    check_headers(path, meta)     # meta.json against its files' headers: an edited step refused before any setup
    return StartPoint(path=path, how=how, verified=verify and how == "--resume auto", meta=meta)


def agree(section: CheckpointSection, report: Callable[[str], None] = print) -> StartPoint:
    """The start point on every rank: rank 0 decides, one broadcast tells the others (a refusal too, so every rank
    stops with the same line instead of waiting for a decision that never comes)."""
    several = dist.is_initialized() and dist.get_world_size() > 1
    intact = None
    if section.resume == AUTO and section.verify:
        # every rank hashes its share of each candidate (collective), rank 0 decides with the verdicts; the load
        # then hashes nothing again (StartPoint.verified)
        intact = newest_intact_spread(checkpoints_dir(section.output_dir))
    box: list = [None]
    if not several or dist.get_rank() == 0:
        try:
            box[0] = decide(section, report, intact)
        except UserError as exc:
            box[0] = exc
    if several:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):
        raise UserError(str(box[0]))
    return box[0]


# --------------------------------------------------------------------------------------- the settings it carries
def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def _model_settings(meta: dict, flags, explicit: dict, path: str, taken: list, overridden: list) -> None:
    saved = meta["model"]
    want = {dest: saved[field] for dest, field in MODEL_FLAGS.items() if field in saved}
    if "attention_dropout" in want and "dropout" in explicit and "attention_dropout" not in explicit:
        del want["attention_dropout"]                     # it defaults to --dropout, which the user set
    for dest, value in want.items():
        if dest not in explicit:
            setattr(flags, dest, value)
            taken.append(f"{dest}={_show(value)}")
            continue
        given = getattr(flags, dest)
        same = ((given or flags.d_model) == (value or saved["d_model"]) if dest == "ffn_size"    # 0: d_model
                else given == value)
        if same:
            continue
        if MODEL_FLAGS[dest] in SHAPE_FIELDS or dest == "ffn_size":      # (SHAPE_FIELDS names the effective "ffn")
            raise UserError(f"{explicit[dest]} {_show(given)} conflicts with checkpoint {path}, whose weights have "
                            f"{dest}={_show(value)}: they cannot load into another shape. Leave {explicit[dest]} out "
                            f"to continue with the checkpoint's (the layout, dropout and schedule may change)")
        overridden.append(f"{dest}={_show(given)} (checkpoint {_show(value)})")


def _tokenizer(meta: dict, flags, explicit: dict, path: str, taken: list) -> None:
    if "tokenizer" not in explicit:
        tokenizer = recorded_tokenizer(path, meta)     # a missing or changed copy asks for --tokenizer: see below
        if tokenizer is not None:
            flags.tokenizer = tokenizer
            taken.append(f"tokenizer={tokenizer}")
        return
    # the user's tokenizer, whatever became of the copy: it must be the one the weights were trained with
    if (meta.get("tokenizer_sha256") and os.path.isfile(flags.tokenizer)
            and file_sha256(flags.tokenizer) != meta["tokenizer_sha256"]):
        raise UserError(f"{explicit['tokenizer']} {flags.tokenizer} is not the tokenizer checkpoint {path} was "
                        f"trained with (sha256 differs): its token ids would not match the weights. Leave it out "
                        f"to use the checkpoint's own copy ({meta.get('tokenizer')} in it), or give that run's "
                        f"tokenizer file")


def _data_order(meta: dict, flags, explicit: dict, taken: list) -> None:
    order = meta.get("data_order")
    if not (isinstance(order, dict) and order.get("batching") in DATA_ORDER_FLAGS):
        return
    if order["batching"] == "fixed" and "max_tokens" not in explicit:
        flags.max_tokens = 0                              # fixed batches: no token batching
    if order["batching"] == "tokens":
        order = {"num_batch_buckets": 0, **order}         # not recorded when 0
    for dest in DATA_ORDER_FLAGS[order["batching"]]:
        if dest in order and dest not in explicit:
            setattr(flags, dest, order[dest])
            taken.append(f"{dest}={order[dest]}")


def _trajectory(meta: dict, flags, explicit: dict, path: str, taken: list, overridden: list) -> list[str]:
    """The optimisation settings; returns notes (a checkpoint saved before they were recorded, a run that goes past
    its schedule's end)."""
    saved = meta.get("optimization")
    if not isinstance(saved, dict):
        return [f"checkpoint {path} does not record its learning-rate schedule and optimizer settings (saved by an "
                f"older version): this run uses the flags' values for them"]
    for dest in TRAJECTORY_FLAGS:
        if dest not in saved:
            continue
        value = saved[dest]
        if dest == "steps" and "epochs" in explicit and "steps" not in explicit:
            continue                                       # --epochs given: its length, not the checkpoint's
        if dest not in explicit:
            setattr(flags, dest, value)
            taken.append(f"{dest}={_show(value)}")
        elif dest != "steps" and getattr(flags, dest) != value:      # (more --steps: the usual way to go on)
            overridden.append(f"{dest}={_show(getattr(flags, dest))} (checkpoint {_show(value)})")
    notes = []
    decays = flags.lr_schedule in ("cosine", "polynomial")
    if decays and flags.steps is not None and flags.decay_steps is not None and flags.steps > flags.decay_steps:
        notes.append(f"the {flags.lr_schedule} schedule ends at step {flags.decay_steps}: steps "
                     f"{flags.decay_steps + 1}-{flags.steps} train at its final rate (--min_lr_ratio "
                     f"{flags.min_lr_ratio:g} × --lr); give --decay_steps {flags.steps} to stretch it instead")
    return notes


def take_settings(cfg: TrainConfig, start: StartPoint) -> tuple[TrainConfig, list[str]]:
    """`cfg` with the checkpoint's settings for every flag the user did not set, and the lines to report (none for
    a fresh start)."""
    if start.fresh:
        return cfg, []
    flags, explicit, path, meta = cfg.to_flags(), cfg.explicit, start.path, start.meta
    taken, overridden = [], []
    _model_settings(meta, flags, explicit, path, taken, overridden)
    _tokenizer(meta, flags, explicit, path, taken)
    _data_order(meta, flags, explicit, taken)
    notes = _trajectory(meta, flags, explicit, path, taken, overridden)
    lines = [f"starting from checkpoint {path} ({start.how}): its settings "
             + (" ".join(taken) if taken else "(none needed)")]
    if overridden:
        lines.append("overridden by flags: " + " ".join(overridden))
    return TrainConfig.from_flags(flags), lines + notes


def trajectory(cfg: TrainConfig, total_steps: int) -> dict:
    """What a checkpoint records of the optimisation (meta.json "optimization"), the horizon and length resolved."""
    opt = cfg.optimization
    values = {dest: getattr(opt, dest) for dest in TRAJECTORY_FLAGS}
    values.update(decay_steps=opt.horizon(total_steps), steps=total_steps)
    return values
