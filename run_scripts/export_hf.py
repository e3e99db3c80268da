#!/usr/bin/env python3
"""The installed `dstr-export-hf` command run from the repository; code: training/cli/export_hf.py.

This file stays for the commands, recipes and launchers that name it (`--help` lists the flags).
"""

import sys

try:
    from common.script_entry import require_own_checkout
except ModuleNotFoundError:  # no package to import: one line, not a traceback
    print(
        "error: this checkout's Python packages are not installed (or an older copy is): run `pip install -e .` "
        "in the checkout (README), or set PYTHONPATH to its folder",
        file=sys.stderr,
    )
    sys.exit(2)
require_own_checkout(__file__)  # and it is this checkout's (common/script_entry.py)

from common.errors import run_cli  # after the checkout check
from training.cli.export_hf import main  # after the checkout check

if __name__ == "__main__":
    run_cli(main)
