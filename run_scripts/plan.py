#!/usr/bin/env python3
"""Plan a run without starting it: check a recipe against a world size or hostfile, and print the layout, the
rank → (node, dp, tp, pp) table, the blocks of every pipeline stage, per-rank parameter / gradient / optimizer
bytes, an activation estimate and the communication per step. No process group, no DeepSpeed engine, no data.

    python run_scripts/plan.py --recipe recipes/16pcs/16pcs.json --world_size 16
    python run_scripts/plan.py --recipe recipes/16pcs/16pcs.json --hostfile run_scripts/hostfiles/hostfile_2nodes
    python run_scripts/plan.py --recipe recipes/8pcs/8pcs.json --world_size 8 --d_model 1024 --json

Flags as train.py (they override the recipe), plus --world_size / --hostfile / --gpus_per_node / --json / --check.
The computation lives in training/plan/planner.py; `--help` lists every flag.
"""

from __future__ import annotations

import os
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

# Planning never touches a GPU (it runs on login nodes too): DeepSpeed's CPU accelerator, without its
# "unable to detect" warning on stdout, which would also break --json.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from common.errors import run_cli
from training.plan.planner import main

if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
