"""Training on DeepSpeed: the trainer (load → step → validate → save) and one sub-package per concern — config,
core, checkpoint (with the guards of its writes), run (the run's lifecycle: start point, lock, signals, supervision),
evaluation, plan. run_scripts/train.py stays thin."""
