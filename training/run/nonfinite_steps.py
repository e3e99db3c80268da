"""Non-finite steps (`--nan_policy stop|skip`): what the run does after one.

A step whose gradient is not finite never changes the weights, under every optimizer this repository builds:
DeepSpeed's wrappers (ZeRO 1-3, BF16_Optimizer, the fp16 loss scaler) treat an inf/nan global gradient norm as an
overflow, drop the update and set `optimizer.overflow`, and `ClippingAdamW` (fp32 at ZeRO 0) does the same
(training.core.grad_norm). DeepSpeed's engine then counts the step in `engine.skipped_steps` and does not advance the
learning-rate schedule (`DeepSpeedEngine._take_model_step` in DeepSpeed 0.19.8). The global norm is one all-reduced
number, so every rank decides alike, with no extra collective.

What remains is the run's decision, here, from numbers identical on every rank (the global-batch loss and the
engine's skipped-step count):
- `stop` (default): a non-finite loss, or a step dropped for a non-finite gradient, ends the run with one line
  naming the step, before that step validates or saves; the last checkpoint stays the latest.
- `skip`: the run goes on; metrics.jsonl carries `skipped_steps` (cumulative). After `--nan_skip_limit` non-finite
  steps in a row it stops too, since the weights will not recover by themselves. fp16's loss scaler skips steps
  whose gradient overflowed while the loss was finite: that is calibration, never a reason to stop.

No checkpoint holds non-finite weights: training.checkpoint.nonfinite. The tests make real non-finite steps through
training.faults_for_tests.
"""

from __future__ import annotations

import math


class NonFiniteSteps:
    def __init__(self, engine, policy: str, skip_limit: int, lr: float, latest_checkpoint):
        self.engine, self.policy, self.skip_limit, self.lr = engine, policy, max(1, int(skip_limit)), lr
        self.latest_checkpoint = latest_checkpoint  # () -> the latest checkpoint's path, or None
        self.skipped_before = engine.ds.skipped_steps
        self.in_a_row = 0

    def after_step(self, step: int, loss: float, record: dict) -> str | None:
        """Add `skipped_steps` to the step's record; the message to stop with, or None."""
        skipped_now = self.engine.ds.skipped_steps
        dropped = skipped_now > self.skipped_before  # this step's update was not applied
        self.skipped_before = skipped_now
        record["skipped_steps"] = skipped_now
        bad_loss = not math.isfinite(loss)
        fp16_calibration = self.engine.precision == "fp16" and not bad_loss
        bad = bad_loss or (dropped and not fp16_calibration)
        self.in_a_row = self.in_a_row + 1 if bad else 0
        if not bad:
            return None
        what = f"the loss is {loss}" if bad_loss else "the gradient is not finite (its norm is inf or nan)"
        latest = self.latest_checkpoint()
        keep = f"the latest checkpoint stays {latest}" if latest else "no checkpoint was written"
        if not dropped:  # cannot happen with the optimizers built here
            return f"step {step}: {what} and the optimizer applied the update; stopped ({keep})"
        if self.policy == "stop":
            return (
                f"step {step}: {what}, so training stopped (--nan_policy stop; the step's update was dropped, "
                f"{keep}). Lower --lr (now {self.lr:g}) or set --clip_grad, or pass --nan_policy skip to go "
                f"on without such steps"
            )
        if self.in_a_row >= self.skip_limit:
            steps = "step" if self.in_a_row == 1 else "steps"
            return (
                f"step {step}: {self.in_a_row} non-finite {steps} in a row (--nan_skip_limit {self.skip_limit}), "
                f"so training stopped; the weights are not recovering ({keep}). Lower --lr (now {self.lr:g})"
            )
        return None
