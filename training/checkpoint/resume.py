"""Where a run starts: which checkpoint `--resume` / `--ckpt_file` name, and refusing starts that would mix two
histories in one output folder.

`resume_source(section)` is what train.py loads: `--resume` (the folder's latest), `--resume auto` (the newest
checkpoint of the folder that verifies — complete, and every file matching the sha256 stored at save — skipping and
naming the others; else `--ckpt_file`, else nothing), `--resume PATH` (that checkpoint), `--ckpt_file PATH`.
`check_start_point` refuses a
fresh run into a folder that already holds checkpoints (its saves would replace them and `latest` would jump between
two histories), a run from a checkpoint elsewhere, and one from an older checkpoint of this folder while newer ones
exist. It runs on global rank 0 under the output folder's lock (training.run.output_lock.claim_output_dir).
"""
from __future__ import annotations

import os

from common.errors import UserError
from training.checkpoint.folder import (
    checkpoints_dir,
    latest_checkpoint,
    resolve,
    saved_checkpoints,
    step_checkpoints,
    step_of,
)
from training.checkpoint.format import read_meta, verify_checkpoint
from training.config.sections import CheckpointSection

AUTO = "auto"


LATEST = "latest"                                 # --resume without a value


def newest_intact(root: str, verify: bool = True) -> tuple[str | None, list[str]]:
    """(the newest step_* checkpoint of `root` that verifies, or None; "step_N: why" for each newer one skipped).
    verify=False checks completeness only (meta.json and the files it lists), not the checksums."""
    skipped = []
    for path in step_checkpoints(root):
        try:
            verify_checkpoint(path, with_tokenizer=True) if verify else read_meta(path)
            return path, skipped
        except UserError as exc:
            skipped.append(f"{os.path.basename(path)}: {exc}")
    return None, skipped


def resume_source(section: CheckpointSection, verify: bool = False, report=None,
                  intact: tuple | None = None) -> str | None:
    """The checkpoint folder this run starts from, or None for a fresh start (UserError when there is none where
    the flags say there must be one). `verify`: with --resume auto, check the candidates' checksums too; `intact`:
    newest_intact's answer already found (train.py's ranks together: training.checkpoint.spread_verify);
    `report(line)` is told which ones were skipped."""
    resume, ckpt_file = section.resume, section.ckpt_file
    if resume not in (None, AUTO, LATEST):                     # --resume PATH
        if ckpt_file:
            raise UserError(f"--resume {resume} and --ckpt_file {ckpt_file} both name a checkpoint; give one")
        return resolve(resume)
    if resume == AUTO:
        root = checkpoints_dir(section.output_dir)
        found, skipped = intact if intact is not None else newest_intact(root, verify)
        for line in skipped:
            if report is not None:
                report(f"--resume auto: skipping {line}")
        if found:
            return found
        if skipped:
            raise UserError(f"--resume auto: no intact checkpoint in {root} (skipped: "
                            + "; ".join(s.split(":", 1)[0] for s in skipped) + "); move the damaged ones away to "
                            "start fresh, or name a checkpoint with --resume PATH")
        return resolve(ckpt_file) if ckpt_file else None
    if resume is not None:
        root = checkpoints_dir(section.output_dir)
        found = latest_checkpoint(root) if os.path.isdir(root) else None
        if found:
            return found
        if ckpt_file:
            return resolve(ckpt_file)
        if resume != AUTO:
            raise UserError(f"--resume: no checkpoint in {root}; use --resume auto to start fresh when there "
                            f"is none, or --ckpt_file PATH")
        return None
    return resolve(ckpt_file) if ckpt_file else None


def check_start_point(section: CheckpointSection, source: str | None) -> None:
    """Refuse a start that would mix two histories in OUTPUT_DIR's checkpoints (see the module docstring)."""
    saved = saved_checkpoints(section.output_dir)
    if not section.train or not saved:
        return
    root = os.path.realpath(checkpoints_dir(section.output_dir))
    steps = [(step_of(n), n) for n in saved if n.startswith("step_")]                         # not best/
    newest = max(((s, n) for s, n in steps if s is not None), default=None)
    what = f"checkpoints up to {newest[1]}" if newest else f"checkpoints ({', '.join(saved[:3])})"
    if source is None:
        raise UserError(f"--output_dir {section.output_dir} already holds {what} and this run starts fresh: its saves "
                        f"would replace them. Continue that run with --resume (or --resume auto), or choose "
                        f"another --output_dir")
    source_real = os.path.realpath(source)
    own_latest = latest_checkpoint(root, strict=False)        # `latest` naming a missing step: not the source
    if own_latest and os.path.realpath(own_latest) == source_real:
        return                                                 # the folder's own run continues
    if section.resume == AUTO and os.path.dirname(source_real) == root:
        return                        # the newest intact one: later ones were skipped as damaged (and said so)
    if os.path.dirname(source_real) != root:
        raise UserError(f"--output_dir {section.output_dir} already holds {what} of its own; continuing {source} "
                        f"there would mix two runs. Choose another --output_dir (or pass --resume alone to "
                        f"continue {section.output_dir}'s own run)")
    step = step_of(source_real)
    if newest is not None and step is not None and step < newest[0]:
        raise UserError(f"{source} is step {step}, but {section.output_dir} also holds later checkpoints (up to "
                        f"{newest[1]}) that this run would overwrite one by one. Start from it in another "
                        f"--output_dir, or move the later checkpoints away first")
