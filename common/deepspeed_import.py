"""Keep DeepSpeed's autotuner from importing MLflow: `import deepspeed` imports deepspeed.autotuning.autotuner,
which imports mlflow whenever it is installed (train.py's `--mlflow` extra) — 1.4 s more per process start, on
every rank of every launch, for a tool this repository never runs. Only that module is refused mlflow (it falls
back to running without it); train.py's own `import mlflow` is untouched."""

from __future__ import annotations

import importlib.abc
import sys

AUTOTUNER = "deepspeed.autotuning.autotuner"


class _NoMlflowForTheAutotuner(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "mlflow":
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == AUTOTUNER:
                raise ModuleNotFoundError(
                    "not imported for DeepSpeed's autotuner (common/deepspeed_import.py)", name="mlflow"
                )
            frame = frame.f_back
        return None


def keep_mlflow_out_of_deepspeed() -> None:
    """Install the refusal once per process, ahead of the finders that would find mlflow."""
    if not any(isinstance(f, _NoMlflowForTheAutotuner) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoMlflowForTheAutotuner())
