"""Record every collective a process issues — op, dtype, element count and the global ranks of its group — below
torch.distributed and DeepSpeed's comm layer.

`CollectiveTrace` is a `TorchDispatchMode`: every torch.distributed collective reaches the dispatcher as a `c10d`
op (`c10d.allreduce_`, `c10d.reduce_`, `c10d.reduce_scatter_`, `c10d._allgather_base_`, ...) whatever Python path
issued it — torch.distributed directly, deepspeed.comm, or a function DeepSpeed cached when its backend started —
so nothing can bypass the record, in forward, in backward (autograd keeps the mode on its CPU thread) or in the
optimizer step. Used by tests/drivers/train_many.py --trace_collectives (tests/test_grad_reduce_dtype.py).

    with CollectiveTrace() as trace:
        ...train...
    trace.records   # [{"op": "allreduce_", "dtype": "float32", "numel": 1234, "ranks": [0, 1]}, ...]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.device_check import _tensors  # every tensor in a collective's (nested) arguments

# the c10d ops that combine values from several ranks (as opposed to moving them: gathers, broadcasts, sends)
REDUCTIONS = {
    "allreduce_",
    "allreduce_coalesced_",
    "reduce_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
}
HALF = {"float16", "bfloat16"}
# the c10d ops whose first argument is what the rank contributes (the others take their output first)
INPUT_FIRST = {
    "allreduce_",
    "allreduce_coalesced_",
    "reduce_",
    "broadcast_",
    "send",
    "recv_",
    "recv_any_source_",
    "barrier",
    "monitored_barrier_",
}


def _group_ranks(args) -> list[int]:
    """The global ranks of the process group among a c10d op's arguments (boxed as a ScriptObject)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return sorted(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
            except RuntimeError:  # another boxed argument (the ReduceOp)
                continue
    return []


def _input(op: str, args) -> list:
    """The tensors whose values a rank contributes to a c10d op."""
    return list(_tensors(args[0] if op in INPUT_FIRST or len(args) < 2 else args[1]))


class CollectiveTrace(TorchDispatchMode):
    """Logs (op, dtype, numel, ranks) of every c10d collective run under it, in call order."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            op = func.__name__.split(".")[0]
            tensors = _input(op, args)
            if tensors:
                self.records.append(
                    {
                        "op": op,
                        "dtype": str(tensors[0].dtype).replace("torch.", ""),
                        "numel": sum(t.numel() for t in tensors),
                        "ranks": _group_ranks(args),
                    }
                )
        return func(*args, **(kwargs or {}))
