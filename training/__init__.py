"""Training on DeepSpeed: the trainer (load → step → validate → save) and one sub-package per concern — config,
core, checkpoint, faults, evaluation, plan. run_scripts/train.py stays thin."""
