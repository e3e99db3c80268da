#!/usr/bin/env python3
"""The seed's parallel_recover_train.py: continue training from a checkpoint given by --ckpt_file, under the same
or any other parallel layout (it is resharded at load time), saving every step as parallel_save_ckpt_train.py does.

    deepspeed --num_gpus 2 run_scripts/parallel_recover_train.py --file_path DATA.tsv --pipeline_stage 2 \
        --micro_batch_num 2 --steps 20 --ckpt_file out/save --output_dir out/recover
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

from common.errors import UserError, run_cli  # after the checkout check
from training.cli.train import main as train_main  # after the checkout check


def main():
    asks_help = any(a in ("-h", "--help") for a in sys.argv[1:])  # train.py's flags, this script's defaults
    if not asks_help and not any(a == "--ckpt_file" or a.startswith("--ckpt_file=") for a in sys.argv[1:]):
        raise UserError("parallel_recover_train.py needs --ckpt_file PATH (a step_* folder or a run's output_dir)")
    return train_main(["--save_checkpoint_steps", "1", "--keep_checkpoint_max", "4"] + sys.argv[1:])


if __name__ == "__main__":
    run_cli(main)
