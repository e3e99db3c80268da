"""Where a run starts — fresh, `--resume` (the folder's latest), `--resume auto`, `--resume PATH`, or `--ckpt_file`
onto another layout — decided here alone: by train.py's global rank 0, once, and by the launch scripts before any
process starts (training.run.launch_check asks `held_checkpoints`, the same rule).

    start = agree(cfg.checkpoint)            # every rank, once the process group exists
    cfg, lines = take_settings(cfg, start)   # training.checkpoint.carried_settings: what the checkpoint carries

Rank 0 decides under the output folder's lock (training.run.output_lock): which checkpoint the flags name
(`resume_source`; with --resume auto the newest whose checksums verify — every rank hashing its share of each
candidate, training.checkpoint.spread_verify), whether starting there would mix two runs in one folder
(`check_start_point`: a fresh run into a folder that already holds checkpoints, whose saves would replace them and
move `latest` between two histories; a run from a checkpoint elsewhere; one from an older checkpoint of this folder
while newer ones exist), and reads its meta.json. One broadcast gives every rank the same answer — or the same
one-line refusal. `StartPoint.fresh` is the run's fresh-or-continued answer: the metrics, trackers and run record
take it from here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import UserError
from training.checkpoint.folder import (
    checkpoints_dir,
    latest_checkpoint,
    resolve,
    saved_checkpoints,
    step_checkpoints,
    step_of,
)
from training.config.sections import RESUME_AUTO as AUTO
from training.config.sections import RESUME_LATEST as LATEST
from training.config.sections import CheckpointSection

# the launch scripts import this module before anything starts: torch (checkpoint formats, the process group) is
# imported by the functions that need it, not here


@dataclass(frozen=True)
class StartPoint:
    path: str | None = None  # the checkpoint folder; None: a fresh start
    how: str = "fresh"  # the flag that chose it
    verified: bool = False  # every file already checked against its sha256 by the job (--resume auto)
    meta: dict | None = None  # its meta.json

    @property
    def fresh(self) -> bool:
        return self.path is None


# ------------------------------------------------------------------------------------------------- the policy
def held_checkpoints(output_dir: str) -> str | None:
    """'checkpoints up to step_N' (or their names) when OUTPUT_DIR holds complete checkpoints, else None: what a
    start without --resume there would overwrite."""
    saved = saved_checkpoints(output_dir)
    if not saved:
        return None
    newest = _newest_step(saved)
    return f"checkpoints up to {newest}" if newest else f"checkpoints ({', '.join(saved[:3])})"


def _newest_step(saved: list[str]) -> str | None:
    steps = [name for name in saved if name.startswith("step_") and step_of(name) is not None]  # not best/
    return max(steps, key=step_of) if steps else None


def newest_intact(root: str, verify: bool = True) -> tuple[str | None, list[str]]:
    """(the newest step_* checkpoint of `root` that verifies, or None; "step_N: why" for each newer one skipped).
    verify=False checks completeness only (meta.json and the files it lists), not the checksums."""
    from training.checkpoint.format import read_meta, verify_checkpoint

    skipped = []
    for path in step_checkpoints(root):
        try:
            verify_checkpoint(path, with_tokenizer=True) if verify else read_meta(path)
            return path, skipped
        except UserError as exc:
            skipped.append(f"{os.path.basename(path)}: {exc}")
    return None, skipped


def _resume_auto(section: CheckpointSection, verify: bool, report, intact: tuple | None) -> str | None:
    root = checkpoints_dir(section.output_dir)
    found, skipped = intact if intact is not None else newest_intact(root, verify)
    for line in skipped:
        if report is not None:
            report(f"--resume auto: skipping {line}")
    if found:
        return found
    if skipped:
        raise UserError(
            f"--resume auto: no intact checkpoint in {root} (skipped: "
            + "; ".join(s.split(":", 1)[0] for s in skipped)
            + "); move the damaged ones away to "
            "start fresh, or name a checkpoint with --resume PATH"
        )
    return resolve(section.ckpt_file) if section.ckpt_file else None


def resume_source(
    section: CheckpointSection, verify: bool = False, report=None, intact: tuple | None = None
) -> str | None:
    """The checkpoint folder this run starts from, or None for a fresh start (UserError when there is none where
    the flags say there must be one). `verify`: with --resume auto, check the candidates' checksums too; `intact`:
    newest_intact's answer already found (train.py's ranks together: training.checkpoint.spread_verify);
    `report(line)` is told which ones were skipped."""
    resume, ckpt_file = section.resume, section.ckpt_file
    if resume not in (None, AUTO, LATEST):  # --resume PATH
        if ckpt_file:
            raise UserError(f"--resume {resume} and --ckpt_file {ckpt_file} both name a checkpoint; give one")
        return resolve(resume)
    if resume == AUTO:
        return _resume_auto(section, verify, report, intact)
    if resume == LATEST:
        root = checkpoints_dir(section.output_dir)
        found = latest_checkpoint(root) if os.path.isdir(root) else None
        if found:
            return found
        if ckpt_file:
            return resolve(ckpt_file)
        raise UserError(
            f"--resume: no checkpoint in {root}; use --resume auto to start fresh when there is none, "
            f"or --ckpt_file PATH"
        )
    return resolve(ckpt_file) if ckpt_file else None


def check_start_point(section: CheckpointSection, source: str | None) -> None:
    """Refuse a start that would mix two histories in OUTPUT_DIR's checkpoints (see the module docstring)."""
    what = held_checkpoints(section.output_dir)
    if not section.train or what is None:
        return
    if source is None:
        raise UserError(
            f"--output_dir {section.output_dir} already holds {what} and this run starts fresh: its saves "
            f"would replace them. Continue that run with --resume (or --resume auto), or choose "
            f"another --output_dir"
        )
    root = os.path.realpath(checkpoints_dir(section.output_dir))
    source_real = os.path.realpath(source)
    own_latest = latest_checkpoint(root, strict=False)  # `latest` naming a missing step: not the source
    if own_latest and os.path.realpath(own_latest) == source_real:
        return  # the folder's own run continues
    if section.resume == AUTO and os.path.dirname(source_real) == root:
        return  # the newest intact one: later ones were skipped as damaged (and said so)
    if os.path.dirname(source_real) != root:
        raise UserError(
            f"--output_dir {section.output_dir} already holds {what} of its own; continuing {source} "
            f"there would mix two runs. Choose another --output_dir (or pass --resume alone to "
            f"continue {section.output_dir}'s own run)"
        )
    step, newest = step_of(source_real), _newest_step(saved_checkpoints(section.output_dir))
    if newest is not None and step is not None and step < step_of(newest):
        raise UserError(
            f"{source} is step {step}, but {section.output_dir} also holds later checkpoints (up to "
            f"{newest}) that this run would overwrite one by one. Start from it in another "
            f"--output_dir, or move the later checkpoints away first"
        )


def _how(section: CheckpointSection, path: str | None) -> str:
    if path is None:
        return "fresh"
    if section.resume not in (None, AUTO, LATEST):
        return f"--resume {section.resume}"
    if section.resume is not None and os.path.dirname(os.path.realpath(path)) == os.path.realpath(
        checkpoints_dir(section.output_dir)
    ):
        return "--resume auto" if section.resume == AUTO else "--resume"
    return "--ckpt_file"


# ------------------------------------------------------------------------------------------------ the decision
def decide(
    section: CheckpointSection, report: Callable[[str], None] = print, intact: tuple | None = None
) -> StartPoint:
    """Rank 0's decision (under the output folder's lock); UserError when the flags name no usable start.
    `intact`: --resume auto's candidates already verified (newest_intact_spread)."""
    from training.checkpoint.format import check_headers, read_meta

    verify = section.resume == AUTO and section.verify
    path = resume_source(section, verify=verify, report=report, intact=intact)
    check_start_point(section, path)
    if path is None:
        return StartPoint()
    how = _how(section, path)
    meta = read_meta(path)
    check_headers(path, meta)  # meta.json against its files' headers: an edited step refused before any setup
    return StartPoint(path=path, how=how, verified=verify and how == "--resume auto", meta=meta)


def agree(section: CheckpointSection, report: Callable[[str], None] = print) -> StartPoint:
    """The start point on every rank: rank 0 decides, one broadcast tells the others (a refusal too, so every rank
    stops with the same line instead of waiting for a decision that never comes)."""
    import torch.distributed as dist

    from training.checkpoint.spread_verify import newest_intact_spread

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
