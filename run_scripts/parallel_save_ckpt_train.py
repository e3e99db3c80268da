#!/usr/bin/env python3
"""The seed's parallel_save_ckpt_train.py: train.py saving a sliced checkpoint every step, keeping the last 4
(the seed's CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=4, integrated_save=False)).

    deepspeed --num_gpus 2 run_scripts/parallel_save_ckpt_train.py --file_path DATA.tsv --mp 2 --steps 10 \
        --output_dir out/save
Any train.py flag works and overrides these defaults (e.g. --save_checkpoint_steps 100).
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
from training.cli.train import main  # after the checkout check

DEFAULTS = ["--save_checkpoint_steps", "1", "--keep_checkpoint_max", "4"]

if __name__ == "__main__":
    run_cli(lambda: main(DEFAULTS + sys.argv[1:]))
