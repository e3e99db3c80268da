"""Learning-rate schedules: the factor the peak learning rate (`--lr`) is multiplied by before optimizer step k.

Every schedule starts with a linear warmup over `--warmup_steps` (factor (k+1)/warmup), then:

    constant      1
    inverse_sqrt  sqrt(warmup / (k+1))                          (fairseq's; continuous at the end of warmup)
    cosine        min + (1 - min) · ½(1 + cos(π·p))              p = (k - warmup) / (total - warmup), clipped to 1
    polynomial    min + (1 - min) · (1 - p)^power               the seed's family (MindSpore's warmup + polynomial
                                                                 decay); power 1 is linear decay
    min = --min_lr_ratio (default 0)

The factor is a pure function of the step, so a resumed run (any layout) continues the schedule exactly from the
step stored in the checkpoint. Changing --steps on resume changes where cosine/polynomial end.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from common.errors import UserError

SCHEDULES = ("constant", "inverse_sqrt", "cosine", "polynomial")


def lr_factor(
    kind: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0, power: float = 1.0
) -> Callable[[int], float]:
    check_schedule(kind, warmup_steps, total_steps, min_ratio, power)

    def factor(k: int) -> float:
        if k < warmup_steps:
            return (k + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        if kind == "inverse_sqrt":
            return math.sqrt(max(warmup_steps, 1) / (k + 1))
        progress = min(1.0, (k - warmup_steps) / max(total_steps - warmup_steps, 1))
        if kind == "cosine":
            return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress) ** power

    return factor


def check_schedule(kind: str, warmup_steps: int, total_steps: int, min_ratio: float, power: float) -> None:
    if kind not in SCHEDULES:
        raise UserError(f"--lr_schedule {kind!r} is not one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0:
        raise UserError(f"--warmup_steps {warmup_steps} must be >= 0")
    if not 0.0 <= min_ratio <= 1.0:
        raise UserError(f"--min_lr_ratio {min_ratio} must be in [0, 1] (a fraction of --lr)")
    if power <= 0:
        raise UserError(f"--lr_power {power} must be > 0")
    if kind in ("cosine", "polynomial") and total_steps <= warmup_steps:
        raise UserError(
            f"--lr_schedule {kind} decays from --warmup_steps {warmup_steps} to the last step, but the "
            f"run has {total_steps} steps; use more --steps or fewer --warmup_steps"
        )
