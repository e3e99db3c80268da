"""What a checkpoint folder holds for DeepSpeed's users: zero_to_fp32.py, as DeepSpeed puts its own beside its
checkpoints (its engine's _copy_recovery_script) — ours reads this format — and a note that DeepSpeed's own
`python -m deepspeed.utils.zero_to_fp32` finds instead of failing on an empty glob (docs/checkpoints.md).

The checkpoints/ folder itself gets the script too, with a one-line hint beside `latest`: DeepSpeed saves into the
folder it is given, so that is where its users look, and run from there the script consolidates the latest step."""

from __future__ import annotations

import os
import shutil

import torch

from training.checkpoint.folder import write_atomic

SCRIPT = "zero_to_fp32.py"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), SCRIPT)
# DeepSpeed's zero_to_fp32 globs `*_model_states.pt` in the folder `latest` names and fails naming the first file
# it finds that lacks its keys: this name is then its error message
NOTE = "NOT-A-DEEPSPEED-CHECKPOINT_run-zero_to_fp32.py-in-this-folder_model_states.pt"
NOTE_TEXT = (
    "This folder is a ds-transformer-recipes checkpoint (format 2: safetensors shards and meta.json), not "
    "DeepSpeed's format. Consolidate it with `python zero_to_fp32.py . model.safetensors` from this folder, "
    "or `python run_scripts/merge_checkpoint.py CHECKPOINT --output model.safetensors` in the repository."
)


HINT = "NOT-A-DEEPSPEED-CHECKPOINT.txt"
HINT_TEXT = (
    "Not DeepSpeed's format (ds-transformer-recipes, format 2): `python zero_to_fp32.py . model.safetensors` "
    "here consolidates the latest step (DeepSpeed's own zero_to_fp32 cannot read these folders).\n"
)


def ship_folder_hint(checkpoints: str) -> None:
    """The script and the one-line hint into a run's checkpoints/ folder, each written whole and renamed into place
    (a user may be running the script while a save rewrites it; a crash leaves a .part the next start removes)."""
    with open(SOURCE, "rb") as f:
        script = f.read()
    dst = os.path.join(checkpoints, SCRIPT)
    write_atomic(dst, lambda f: f.write(script))
    mode = os.stat(dst).st_mode
    os.chmod(dst, mode | (mode & 0o444) >> 2)
    write_atomic(os.path.join(checkpoints, HINT), lambda f: f.write(HINT_TEXT.encode()))


def ship_recovery_files(folder: str) -> None:
    """Copy the script into `folder`, executable wherever it is readable (the umask decides, as for any file), and
    write the note."""
    dst = os.path.join(folder, SCRIPT)
    shutil.copyfile(SOURCE, dst)
    mode = os.stat(dst).st_mode
    os.chmod(dst, mode | (mode & 0o444) >> 2)
    torch.save({"note": NOTE_TEXT}, os.path.join(folder, NOTE))
