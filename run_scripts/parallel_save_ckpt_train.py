#!/usr/bin/env python3
"""The seed's parallel_save_ckpt_train.py: train.py saving a sliced checkpoint every step, keeping the last 4
(the seed's CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=4, integrated_save=False)).

    deepspeed --num_gpus 2 run_scripts/parallel_save_ckpt_train.py --file_path DATA.tsv --mp 2 --steps 10 \
        --output_dir out/save
Any train.py flag works and overrides these defaults (e.g. --save_checkpoint_steps 100).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train

DEFAULTS = ["--save_checkpoint_steps", "1", "--keep_checkpoint_max", "4"]

if __name__ == "__main__":
    train.run_cli(lambda: train.main(DEFAULTS + sys.argv[1:]))
