"""The global gradient norm of the whole model, exactly the serial model's, and clipping by it.

Under TP and PP each rank holds part of the model: TP-sharded parameters (tagged by
`model.parallel.layers.mark_tensor_parallel`) are disjoint slices on the TP ranks, replicated parameters (LayerNorms,
row-parallel biases, replicated embedding tables) are identical copies on every TP rank of a stage, and each
pipeline stage holds its own layers. So the serial ‖g‖² is the sum over the model-parallel group (every stage × TP
rank of one data-parallel replica) of: every sharded parameter's ‖g‖², plus the replicated parameters' ‖g‖² on TP
rank 0 only. Parameters DeepSpeed marks as pipe-replicated (tied copies on a non-owning stage) are skipped.

`ClippingAdamW` applies this where DeepSpeed hands the step to the client optimizer unwrapped (fp32, ZeRO 0): at
the accumulation boundary, after the data-parallel gradient all-reduce. DeepSpeed's own fp32 clipping
(`clip_grad_norm_`) counts replicated parameters only where the grid's model-parallel rank — a rank over pipe × TP
on `PipelineParallelGrid` — is 0, which drops the replicated parameters of every stage but the first. The optimizers
DeepSpeed wraps (ZeRO 1–3, BF16_Optimizer) count them by the TP rank and compute the same norm themselves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


def global_grad_norm(params: Iterable[torch.nn.Parameter], tp_rank: int, group) -> torch.Tensor:
    """‖g‖₂ of the serial model's gradient, as a float32 tensor on the gradients' device, identical on every rank
    of `group` (the model-parallel group: all stages × TP ranks; None for one process). Collective over `group`."""
    squares, device = [], None
    for p in params:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        device = p.grad.device
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            # a plain sum of squares: torch's CPU vector_norm accumulates float32 serially (relative error 2e-5 at
            # 256k elements, 7e-4 at 4M), while sum() reduces pairwise
            squares.append(p.grad.detach().float().square().sum())
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()


class ClippingAdamW(torch.optim.AdamW):
    """AdamW that measures the exact global gradient norm before each step (`last_grad_norm`, pre-clip) and, with
    `max_norm > 0`, scales the gradients by max_norm / (norm + 1e-6) when that is below 1 — torch's and
    DeepSpeed's clipping rule.

    A step whose norm is inf or nan is dropped (no update, no AdamW state change) and `overflow` is set, as
    DeepSpeed's own optimizer wrappers do: DeepSpeed's engine reads `optimizer.overflow` after every step, counts the
    step in `skipped_steps` and holds the learning-rate schedule (`_take_model_step`, DeepSpeed 0.19.8). The norm
    is the same number on every rank, so all ranks drop the same steps."""

    def __init__(self, params, *, max_norm: float, tp_rank: int, norm_group, **adamw_kwargs):
        super().__init__(params, **adamw_kwargs)
        self.max_norm, self.tp_rank, self.norm_group = float(max_norm), tp_rank, norm_group
        self.last_grad_norm = math.nan
        self.overflow = False

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        params = self._params()
        norm = global_grad_norm(params, self.tp_rank, self.norm_group)
        self.last_grad_norm = float(norm)
        self.overflow = not math.isfinite(self.last_grad_norm)
        if self.overflow:
            return None
        if self.max_norm > 0:
            coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
            grads = [p.grad for p in params if p.grad is not None]
            # one fused multiply per dtype and device (torch groups them) instead of a Python loop of kernels;
            # elementwise, so the result is the loop's, bit for bit
            for dtype in {g.dtype for g in grads}:
                torch._foreach_mul_([g for g in grads if g.dtype == dtype], coef.to(dtype))
        return super().step(closure)
