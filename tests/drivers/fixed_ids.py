#!/usr/bin/env python3
"""Run a script (train.py, tests/drivers/train_many.py) with checkpoint and run ids drawn from a counter instead of
the OS, so that two runs that save the same state write byte-identical files (tests/test_background_save.py).

    deepspeed --num_gpus N tests/drivers/fixed_ids.py SCRIPT ARGS...
"""

from __future__ import annotations

import itertools
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

if __name__ == "__main__":
    from training.checkpoint import manager

    counter = itertools.count(1)
    manager._new_id = lambda: next(counter)  # rank 0 draws them (manager._ids): the same on every run
    # a launcher puts --local_rank=N first; the script reads it wherever it is
    local = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    script, *rest = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    sys.argv = [script, *rest, *local]
    runpy.run_path(script, run_name="__main__")  # the script leaves through run_cli
