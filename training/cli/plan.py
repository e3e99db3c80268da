"""The `dstr-plan` command: plan a run without starting it (training/plan/planner.py holds the computation and
the flags; `--help` lists them)."""

from __future__ import annotations

import os
import sys

from common.errors import console_script


def main(argv=None) -> int:
    # Planning never touches a GPU (it runs on login nodes too): DeepSpeed's CPU accelerator, without its
    # "unable to detect" warning on stdout, which would also break --json. Set before DeepSpeed is imported.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from training.plan.planner import main as plan

    return plan(sys.argv[1:] if argv is None else argv)


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
