"""Vocab-parallel cross-entropy: never gathers the full logits, ignores PAD, label smoothing exact under TP.

Each TP rank holds logits for its vocab slice [start, start + V/tp). Three small all-reduces of (tokens,) or
(2, tokens) elements make the loss:
    1. max over the vocab (numerical stability)          MAX
    2. Σ exp(z - max)                                    SUM
    3. [z_target, Σ_v z_v] stacked                       SUM
With label smoothing ε the loss per token is (1-ε)·(-log p_y) + ε·mean_v(-log p_v), the mean over the *true*
vocabulary V (padded columns excluded), which is exactly `F.cross_entropy(..., label_smoothing=ε)` of the serial
model. (Megatron-LM's version averages over the per-rank vocab and gets this wrong under TP.) The backward needs no
communication: d loss / d z_v = p_v - (1-ε)·[v = y] - ε/V.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.parallel.mappings import all_reduce_no_grad


class _VocabParallelCE(torch.autograd.Function):
    # Few passes over the [tokens, V/tp] logits (the largest tensor of a step): masking only where this shard has
    # padded vocab columns, exp in place, and a backward that turns the saved exponentials into the gradient in
    # place (the saved tensor is not read again: the graph is not retained for a second backward).
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, vocab_size, ignore_index, smoothing, group):
        if logits.dtype in (torch.float16, torch.bfloat16):  # statistics in fp32 for half-precision training
            logits = logits.float()
        n_local = logits.shape[-1]
        padded = vocab_start + n_local > vocab_size  # this shard holds padded columns
        valid = torch.arange(vocab_start, vocab_start + n_local, device=logits.device) < vocab_size
        m = (logits.masked_fill(~valid, float("-inf")) if padded else logits).max(dim=-1).values
        all_reduce_no_grad(m, group, op=dist.ReduceOp.MAX)
        z = logits - m.unsqueeze(-1)
        if padded:
            z.masked_fill_(~valid, 0.0)  # padded columns: exp(0) masked below

        in_shard = (labels >= vocab_start) & (labels < vocab_start + n_local)
        local_idx = (labels - vocab_start).clamp(0, n_local - 1)
        z_target = torch.gather(z, -1, local_idx.unsqueeze(-1)).squeeze(-1) * in_shard
        z_sum = z.sum(dim=-1) if smoothing else torch.zeros_like(z_target)
        e = z.exp_()
        if padded:
            e.masked_fill_(~valid, 0.0)
        sum_exp = e.sum(dim=-1)
        all_reduce_no_grad(sum_exp, group)
        stats = torch.stack([z_target, z_sum])
        all_reduce_no_grad(stats, group)
        log_z = torch.log(sum_exp)
        loss = (1.0 - smoothing) * (log_z - stats[0]) + smoothing * (log_z - stats[1] / vocab_size)
        keep = labels != ignore_index
        loss = loss * keep

        ctx.save_for_backward(e, sum_exp, local_idx, in_shard, keep, valid)
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, g):
        e, sum_exp, local_idx, in_shard, keep, valid = ctx.saved_tensors
        grad = e.div_(sum_exp.unsqueeze(-1))  # softmax, in the saved buffer
        target = -(1.0 - ctx.smoothing) * in_shard.to(grad.dtype)
        grad.scatter_add_(-1, local_idx.unsqueeze(-1), target.unsqueeze(-1))
        if ctx.smoothing:
            grad.sub_(valid.to(grad.dtype) * (ctx.smoothing / ctx.vocab_size))
        grad.mul_((g * keep).unsqueeze(-1))
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int,
    smoothing: float = 0.0,
    group=None,
) -> torch.Tensor:
    """Per-token loss [*labels.shape], 0 where labels == ignore_index. logits_shard: [*labels.shape, V/tp]."""
    shape = labels.shape
    loss = _VocabParallelCE.apply(
        logits_shard.reshape(-1, logits_shard.shape[-1]),
        labels.reshape(-1),
        vocab_start,
        vocab_size,
        ignore_index,
        smoothing,
        group,
    )
    return loss.view(shape)


def parallel_cross_entropy_mean(
    logits_shard, labels, vocab_start, vocab_size, ignore_index, smoothing=0.0, group=None
) -> torch.Tensor:
    """Mean over the non-PAD tokens of this batch (the seed's CrossEntropyLoss with its input mask)."""
    loss = vocab_parallel_cross_entropy(logits_shard, labels, vocab_start, vocab_size, ignore_index, smoothing, group)
    return loss.sum() / (labels != ignore_index).sum().clamp(min=1)
