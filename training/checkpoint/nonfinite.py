"""No checkpoint holds non-finite weights: `refuse_non_finite_weights` is checked at the start of every save (a
collective), so a checkpoint is never written from non-finite weights and `latest` and the keep-K pruning never move
past the last finite checkpoint. What a run does after a non-finite step: training.run.nonfinite_steps. The tests make
real non-finite weights through training.faults_for_tests (DSR_INF_WEIGHT_AT)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.errors import UserError


def refuse_non_finite_weights(engine, step: int, latest: str | None) -> None:
    """UserError on every rank when any rank holds a non-finite weight. Collective over the whole job: every rank
    calls it at the same point of save(); the flag is on the engine's device."""
    names, found = [], []
    for name, p in engine.module.named_parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data  # ZeRO-3 keeps this rank's partition
        if local.numel():
            names.append(name)
            found.append((~torch.isfinite(local)).any())
    # one flag for the rank, read once (a read per parameter was a host sync per parameter on a GPU)
    bad = torch.stack(found).any().float() if found else torch.zeros((), device=engine.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bool(bad):
        first = next((n for n, f in zip(names, found) if bool(f)), None)  # the failure path only
        where = f" ({first} on rank {dist.get_rank()})" if first else " (on another rank)"
        keep = f"{latest} stays the latest" if latest else "there is no earlier checkpoint"
        raise UserError(
            f"step {step}: the weights are not finite{where}, so the checkpoint was not written and "
            f"training stopped; {keep}. Lower --lr or set --clip_grad"
        )
