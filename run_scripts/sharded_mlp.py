#!/usr/bin/env python3
"""The seed's quickstart (003): an MLP with one op-level strategy, the rest propagated, on DTensor.

    deepspeed --master_port $(python run_scripts/free_port.py) --num_gpus 8 run_scripts/sharded_mlp.py \
        --output_dir out/mlp                                                          # 8 processes, mesh (2, 4)
    mpirun -n 8 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$(python run_scripts/free_port.py) \
        python run_scripts/sharded_mlp.py
    python run_scripts/sharded_mlp.py --simulate                                      # all 8 ranks in one process
    python run_scripts/sharded_mlp.py --simulate --mesh 8,8 --strategy "((8, 8), (8, 1))"   # plan 64 ranks
    python run_scripts/sharded_mlp.py --check --strategy "((2, 4), (4, 1))"           # strategies only

recipes/sharded-mlp/run.sh wraps the launches. The work is in demos/sharded_mlp/train.py and demos/strategy/.
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
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DTensor on CPU/gloo here; nothing in it needs a GPU

from common.errors import run_cli
from demos.sharded_mlp.train import main

if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
