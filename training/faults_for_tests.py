"""Fault injection for the failure tests, kept out of the modules it tests: each hook does nothing unless its
environment variable is set.

- DSR_CRASH_AT=save:7 or train:7 SIGKILLs global rank 0 in the middle of step 7's save, or right after step 7;
- DSR_SAVE_DELAY=3 holds every save's files back 3 seconds before the commit (a slow disk): with --save_mode
  background training goes on meanwhile, so DSR_CRASH_AT=save:N then kills rank 0 while the save is in flight;
- DSR_NAN_AT=3,5 multiplies the loss of (1-based) steps 3 and 5 by nan on every rank, so the gradients are nan too
  — the real engine then meets a real non-finite step;
- DSR_INF_WEIGHT_AT=6 sets one weight of global rank 0 to inf after step 6 (as memory corruption or an optimizer
  without checks would), so the save that follows meets a rank whose weights are not finite while the others' are;
- DSR_UNTIE_AT=4 nudges the last pipeline stage's replica of the shared embedding table after step 4 (as an
  optimizer that skipped the tied-gradient sum would), so the save that follows meets copies that differ;
- DSR_TRACKER_DOWN_AT=5 SIGKILLs global rank 0's experiment-tracker service (W&B's wandb-core, a child process)
  after step 5, as a crash or an out-of-memory kill of it would: the tracker's next call fails for real;
- DSR_STEP_DELAY=0.2 makes every step 0.2 s longer (a sleep: no CPU), as a big model's step on a GPU is: a job with
  a time limit then needs its requeue after a few hundred steps (tests/test_slurm.py), losses unchanged.
"""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist


def crash_point(where: str, step: int) -> None:
    spec = os.environ.get("DSR_CRASH_AT")
    if spec and spec == f"{where}:{step}" and dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def crash_in_save(step: int) -> None:
    crash_point("save", step)


def slow_save(step: int) -> None:
    time.sleep(float(os.environ.get("DSR_SAVE_DELAY", "0")))


def before_save(step: int) -> None:
    """After step N is logged, before it may be saved: DSR_CRASH_AT=train:N ends rank 0 there."""
    crash_point("train", step)


def arm(engine) -> None:
    """Once, after the engine is built: DSR_SAVE_DELAY and DSR_CRASH_AT=save:N hook into the saves, DSR_NAN_AT's
    steps get a nan loss."""
    from training.checkpoint import manager

    if os.environ.get("DSR_SAVE_DELAY") and slow_save not in manager.BEFORE_COMMIT:
        manager.BEFORE_COMMIT.append(slow_save)  # before the crash: a kill while the save is in flight
    if os.environ.get("DSR_CRASH_AT", "").startswith("save:") and crash_in_save not in manager.BEFORE_COMMIT:
        manager.BEFORE_COMMIT.append(crash_in_save)
    steps = _steps("DSR_NAN_AT")
    if not steps:
        return
    loss_fn = engine.module.loss_fn
    normalize = loss_fn.normalize

    def poisoned(loss_sum):
        out = normalize(loss_sum)
        return out * float("nan") if engine.ds.global_steps + 1 in steps else out

    loss_fn.normalize = poisoned


def _corrupt_one_weight(engine) -> None:
    for p in engine.module.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        if local.numel():
            local.view(-1)[0] = float("inf")
            return


def after_step(engine, step: int) -> None:
    """After every step: DSR_INF_WEIGHT_AT's steps leave an inf weight on global rank 0, DSR_UNTIE_AT's a replica
    of the shared table that differs from its owner, DSR_TRACKER_DOWN_AT's a rank 0 without its tracker service."""
    if step in _steps("DSR_INF_WEIGHT_AT") and dist.get_rank() == 0:
        _corrupt_one_weight(engine)
    if step in _steps("DSR_TRACKER_DOWN_AT") and dist.get_rank() == 0:
        _kill_tracker_service()
    if step in _steps("DSR_UNTIE_AT"):
        for p in engine.module.parameters():
            if getattr(p, "tied_to", None):  # the replica (the owner has no tied_to)
                p.data.view(-1)[0] += 1e-3
    if os.environ.get("DSR_STEP_DELAY"):
        time.sleep(float(os.environ["DSR_STEP_DELAY"]))


def _kill_tracker_service() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if child.name().startswith("wandb"):
                child.kill()
                child.wait(10)
        except psutil.NoSuchProcess:
            pass


def _steps(variable: str) -> set:
    return {int(x) for x in os.environ.get(variable, "").split(",") if x.strip()}
