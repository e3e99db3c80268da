"""What the launch scripts (run_scripts/launch_common.sh) ask before they start anything:

    python -m training.run.launch_check world_size [train.py flags, e.g. --recipe R.json --steps 20]
        the processes the layout is written for, as train.py reads it (--world_size, else the recipe's
        parallel.world_size); nothing when neither says
    python -m training.run.launch_check run_folder RUN_DIR [--resume VALUE] [--earlier RUNS_DIR/NAME]
        one `error:` line (status 2) when this launch must not start in RUN_DIR
    python -m training.run.launch_check data_path DATA_PATH
        DATA_PATH as train.py's --file_path will take it (a TSV, a .jsonl/.json/.csv/.parquet file or a datasets
        save_to_disk folder: its absolute path; a Hub dataset's name: as it is), or the one `error:` line train.py
        would give for it (preprocess.corpus_source decides, for both: the launch scripts refused a save_to_disk
        folder as "not a file" that train.py reads)

A recipe's run folder (RUNS_DIR/<recipe>[-<RUN_NAME>]) is the same for every launch of that recipe and name, so the
"resume with --resume" a stopped run prints works by adding --resume to the same command. Two histories must not
mix there: a launch without --resume into a run folder whose output holds checkpoints is refused here, before any
process starts, naming --resume and RUN_NAME (train.py refuses it too, but names --output_dir, which a run.sh user
never gave). Run folders used to carry their launch's time (RUNS_DIR/NAME-YYYYmmdd-HHMMSS, one per launch): a
`--resume` or `--resume auto` that finds no checkpoint in the run folder while such an earlier folder holds some is
refused naming it — `--resume auto` would otherwise start that run over from step 0.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from common.errors import UserError, run_cli
from training.config.sections import RESUME_AUTO, RESUME_LATEST
from training.run import start_point

OUTPUT = "output"  # a run folder's train.py --output_dir
TIMESTAMPED = r"-\d{8}-\d{6}(-\d+)?"  # the per-launch suffix run folders had: -YYYYmmdd-HHMMSS[-N]


def world_size(argv: list[str]) -> str:
    """The world size train.py would read from these flags (and their recipe), or "" when none is set."""
    from training.config.flags import parse_args

    value = parse_args(argv).world_size
    return "" if value is None else str(value)


def earlier_run_folders(prefix: str) -> list[str]:
    """The folders RUNS_DIR/NAME-<time> earlier launches made (prefix = RUNS_DIR/NAME), newest first."""
    base, name = os.path.split(prefix)
    if not os.path.isdir(base):
        return []
    pattern = re.compile(re.escape(name) + TIMESTAMPED)
    found = [n for n in os.listdir(base) if pattern.fullmatch(n) and os.path.isdir(os.path.join(base, n))]
    return [os.path.join(base, n) for n in sorted(found, reverse=True)]


def check_run_folder(run_dir: str, resume: str | None, earlier: str | None) -> None:
    """UserError when a launch into RUN_DIR would mix two runs, or when --resume would miss the run it means."""
    held = start_point.held_checkpoints(os.path.join(run_dir, OUTPUT))  # train.py's own rule
    if held and resume is None:
        raise UserError(
            f"run folder {run_dir} already holds {held}: add --resume to this command to continue that "
            f"run, or set RUN_NAME=NAME to start a new run beside it"
        )
    if held or resume not in (RESUME_LATEST, RESUME_AUTO) or not earlier:
        return
    for old in earlier_run_folders(earlier):
        old_held = start_point.held_checkpoints(os.path.join(old, OUTPUT))
        if old_held:
            flag = "--resume auto" if resume == RESUME_AUTO else "--resume"
            raise UserError(
                f"{flag}: run folder {run_dir} holds no checkpoint, but {old} (the folder of an earlier "
                f"launch, from before run folders kept their name) holds {old_held}: continue that run "
                f"here with --resume {os.path.join(old, OUTPUT)}, or move {old} away to start afresh"
            )


def data_path(path: str) -> str:
    """DATA_PATH as train.py will take it (module docstring), or UserError naming why train.py would refuse it."""
    from preprocess.corpus_source import FORMATS, CorpusSource

    if CorpusSource(path, flag="DATA_PATH").kind == "hub":  # a Hub dataset's name (train.py reads it online)
        return path
    if not os.path.exists(path):
        raise UserError(
            f"DATA_PATH '{path}' is not a file or folder here; give {FORMATS} (make a TSV with python "
            f"-m preprocess.parallel)"
        )
    return os.path.abspath(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["data_path"] and len(argv) == 2:
        print(data_path(argv[1]))
        return 0
    if argv[:1] == ["world_size"]:
        print(world_size(argv[1:]))
        return 0
    if argv[:1] == ["run_folder"]:
        p = argparse.ArgumentParser(prog="python -m training.run.launch_check run_folder")
        p.add_argument("run_dir")
        p.add_argument("--resume", default=None, help="train.py's --resume value: latest, auto or a path")
        p.add_argument("--earlier", default=None, help="RUNS_DIR/NAME: where earlier launches' folders began")
        args = p.parse_args(argv[1:])
        check_run_folder(args.run_dir, args.resume, args.earlier)
        return 0
    raise UserError(
        "usage: python -m training.run.launch_check world_size [train.py flags] | run_folder RUN_DIR "
        "[--resume VALUE] [--earlier RUNS_DIR/NAME] | data_path DATA_PATH"
    )


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a recipe's deepspeed section imports DeepSpeed: no GPU probe
    run_cli(main)
