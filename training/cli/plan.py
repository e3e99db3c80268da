"""The `dstr-plan` command: plan a run without starting it (training/plan/planner.py holds the computation and
the flags; `--help` lists them)."""
from __future__ import annotations

import os
import sys
from typing import NoReturn

from common.errors import run_cli


def main(argv=None) -> int:
    # Planning never touches a GPU (it runs on login nodes too): DeepSpeed's CPU accelerator, without its
    # "unable to detect" warning on stdout, which would also break --json. Set before DeepSpeed is imported.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from training.plan.planner import main as plan
    return plan(sys.argv[1:] if argv is None else argv)


def cli() -> NoReturn:
    """The console script (setup.cfg): one exit path, user mistakes in one line."""
    run_cli(main)


if __name__ == "__main__":
    cli()
