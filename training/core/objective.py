"""The training objective's normalisation — the one place it is decided.

    loss(step) = Σ CE(t) over the non-PAD target tokens t of the global batch / N,   N = the number of those tokens

whatever the layout. Every rank knows N before the step: the global batch is a pure function of the schedule
(`preprocess.dataset.GlobalBatchSchedule`). DeepSpeed then does two things to what a micro-batch's loss function
returns: it divides it by the accumulation steps (before backward, and when the pipeline engine reports the loss),
and it averages gradients (and the pipeline engine's reported loss) over the data-parallel ranks. So a micro-batch
hands DeepSpeed

    its token-loss sum × dp × accum / N

and after DeepSpeed's 1/accum and 1/dp the sum over all micro-batches of all ranks is exactly the global token
mean. The non-pipelined loop reports the loss the way DeepSpeed's pipeline engine does — mean over the
micro-batches, then mean over the data-parallel ranks — with the reduction on the engine's device (nccl only takes
device tensors).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class GlobalTokenMean:
    def __init__(self, dp_size: int, micro_batches: int):
        self.dp_size, self.micro_batches = int(dp_size), int(micro_batches)
        self._factor: float | None = None

    def begin_step(self, global_tokens: int) -> None:
        """Call on every rank before the step's first micro-batch (N = non-PAD target tokens of the global batch)."""
        self._factor = self.dp_size * self.micro_batches / max(int(global_tokens), 1)

    def micro_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """What a micro-batch's loss function returns to DeepSpeed (see the module docstring)."""
        if self._factor is None:
            raise RuntimeError("GlobalTokenMean.begin_step(global_tokens) must be called before the first micro-batch")
        return loss_sum * self._factor

    def reported(self, micro_losses: Sequence[torch.Tensor], dp_group) -> float:
        """The global-batch loss from this rank's micro-batch losses (as returned by `micro_loss`), identical on
        every rank of the data-parallel group. Collective over `dp_group` when dp > 1."""
        total = torch.stack([loss.detach().float().reshape(()) for loss in micro_losses]).sum() / self.micro_batches
        if self.dp_size > 1:
            dist.all_reduce(total, group=dp_group)
            total = total / self.dp_size
        return float(total)
