"""The two copies of a weight tied across the pipeline (shared embeddings: stage 0's word table and the last
stage's replica in the head) must stay equal; a save refuses to go on when they are not.

They start equal and DeepSpeed sums their gradients over the pair before every optimizer step
(`PipelineEngine._exec_reduce_tied_grads`), so they stay bit-identical — as long as the gradient is where DeepSpeed
looks for it (see training.config.sections.TrainConfig for the combination where it is not). A checkpoint stores
only the owner's copy, so a drifted replica would vanish silently at the next resume while the run before it trained
with both: this check is what makes such a fault visible. Collective over each tie group: every rank of the
first and last stages calls it at the same point of save(); middle stages hold no tied weight and skip it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.errors import UserError


def tied_pairs(engine) -> list:
    """(parameter, group) for every tied weight this rank holds; [] outside a pipeline with shared embeddings."""
    module = engine.module
    if not engine.pipelined or not hasattr(module, "get_tied_weights_and_groups"):
        return []
    return [(p, g) for p, g in module.get_tied_weights_and_groups() if g is not None]


def tied_difference(engine) -> float:
    """max |copy on stage 0 - copy on the last stage| over this rank's tied weights (0.0 when it holds none)."""
    worst = 0.0
    for p, group in tied_pairs(engine):
        local = p.detach().float()
        high, low = local.clone(), local.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        worst = max(worst, float((high - low).abs().max()))
    return worst


def refuse_drifted_tied_copies(engine, step: int, latest: str | None) -> None:
    """UserError on every rank when the copies differ on any: a collective over the whole job in a pipeline."""
    if not engine.pipelined:
        return
    diff = tied_difference(engine)  # 0.0 on ranks without a tied weight, which still join the vote below
    flag = torch.tensor([diff > 0.0], dtype=torch.float32, device=engine.device)
    if dist.get_world_size() > 1:  # every rank learns it, so all stop at the same place
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if bool(flag):
        keep = f"{latest} stays the latest" if latest else "there is no earlier checkpoint"
        raise UserError(
            f"step {step}: the two copies of the shared embedding table (stage 0's and the last "
            f"stage's) differ by up to {diff:.3g}, so the checkpoint was not written and training "
            f"stopped; {keep}. This is a bug: please report the flags of this run"
        )
