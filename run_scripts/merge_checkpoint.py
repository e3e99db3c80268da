#!/usr/bin/env python3
"""The installed `dstr-merge-checkpoint` command run from the repository; code: training/cli/merge_checkpoint.py.

This file stays for the commands, recipes and launchers that name it (`--help` lists the flags).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from any directory

from common.errors import run_cli  # noqa: E402 - after the path insert
from training.cli.merge_checkpoint import main, merge, save  # noqa: E402,F401 - importable from here, as before

if __name__ == "__main__":
    run_cli(main)
