"""Reusable training code: DeepSpeed engine setup, the step loop, metrics and checkpoints (train.py stays thin)."""
