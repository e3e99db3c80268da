"""The tensor-parallel collectives, each an autograd function named for what it does forward / backward.

    copy_to_tp      forward: identity            backward: all-reduce   (enter a TP region with a replicated input)
    reduce_from_tp  forward: all-reduce          backward: identity     (leave a TP region: sum partial results)
    gather_from_tp  forward: all-gather last dim backward: split        (assemble a sharded activation)
    scatter_to_tp   forward: split last dim      backward: all-gather   (take this rank's shard)
    all_reduce_no_grad                                                   (loss statistics: max, sum-exp, ...)

Asynchronous variants (`async_op=True`), for the interleaved schedule of `model.interleave`: the caller does other
work while the all-reduce is in flight and waits only where the result is read.

    reduce_from_tp_async  forward: starts the all-reduce, returns a `PendingAllReduce`   backward: identity
    copy_to_tp_async      forward: identity     backward: starts the input-gradient all-reduce
    await_tp_grad         forward: identity     backward: waits for that all-reduce (placed on the same path,
                                                upstream of copy_to_tp_async, sharing a `GradAllReduce`)

Layers are written as math on top of these and never call torch.distributed directly. With group None (tp=1) every
function is the identity, so the serial model runs the very same code. `CommLog` counts every call and its element
count, which is how the tests prove the per-layer communication is the minimum; the asynchronous ones are
recorded under the same names, and also in `CommLog.async_calls`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist


class CommLog:
    """Records (op, numel) of every TP collective while active; a test opens one with `with CommLog() as log`."""

    _active: CommLog | None = None

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.async_calls: list[tuple[str, int]] = []  # the subset issued with async_op=True

    def __enter__(self):
        CommLog._active = self
        return self

    def __exit__(self, *exc):
        CommLog._active = None

    def count(self, op: str) -> int:
        return sum(1 for o, _ in self.calls if o == op)

    def numel(self, op: str) -> int:
        return sum(n for o, n in self.calls if o == op)


def _record(op: str, t: torch.Tensor, is_async: bool = False) -> None:
    if CommLog._active is not None:
        CommLog._active.calls.append((op, t.numel()))
        if is_async:
            CommLog._active.async_calls.append((op, t.numel()))


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, tag: str = "all_reduce") -> torch.Tensor:
    if group is None:
        return t
    _record(tag, t)
    t = t.contiguous()
    dist.all_reduce(t, op=op, group=group)
    return t


def _start_all_reduce(t: torch.Tensor, group):
    """Sum `t` (contiguous, owned by the caller) over `group` in place, asynchronously; returns the work handle."""
    _record("all_reduce", t, is_async=True)
    return dist.all_reduce(t, group=group, async_op=True)


def _split_last(t: torch.Tensor, group) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return t
    return t.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(t: torch.Tensor, group) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return t
    _record("all_gather", t)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if _world(group) == 1:
            return x.view_as(x)
        if not x.is_contiguous():
            return _all_reduce(x.contiguous(), group)  # contiguous() made a copy: reduce that
        # in place, without a copy: x is the row-parallel product, made for this sum. mark_dirty bumps its version,
        # so autograd refuses (instead of silently using the sum) if anything had saved x for its backward
        ctx.mark_dirty(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class PendingAllReduce:
    """A forward all-reduce in flight (`reduce_from_tp_async`); `wait()` returns the summed tensor."""

    def __init__(self, tensor: torch.Tensor, work=None):
        self._tensor, self._work = tensor, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor


class GradAllReduce:
    """Links one `copy_to_tp_async` (whose backward starts the input-gradient all-reduce) with its `await_tp_grad`
    (whose backward waits for it)."""

    def __init__(self):
        self.work = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _ReduceFromTPAsync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, box):
        y = x.clone(memory_format=torch.contiguous_format)
        box.append(_start_all_reduce(y, group))
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _CopyToTPAsync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, link):
        ctx.group, ctx.link = group, link
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        # Returned while the all-reduce runs: the only consumer of this gradient is the await_tp_grad node, which
        # waits before handing it on (autograd reads nothing in between: one producer, one consumer).
        g = g.clone(memory_format=torch.contiguous_format)
        ctx.link.work = _start_all_reduce(g, ctx.group)
        return g, None, None


class _AwaitTPGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link):
        ctx.link = link
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.link.wait()
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ScatterToTP.apply(x, group)


def reduce_from_tp_async(x: torch.Tensor, group) -> PendingAllReduce:
    """reduce_from_tp, started now and finished by `.wait()`: do other work in between, read only after it."""
    if group is None:
        return PendingAllReduce(x)
    box: list = []
    y = _ReduceFromTPAsync.apply(x, group, box)
    return PendingAllReduce(y, box[0])


def await_tp_grad(x: torch.Tensor, link: GradAllReduce) -> torch.Tensor:
    """Identity; in backward, waits for the all-reduce that `copy_to_tp_async(..., link)` downstream started.
    Work created (in forward) between the two calls runs (in backward) while that all-reduce is in flight."""
    return _AwaitTPGrad.apply(x, link)


def copy_to_tp_async(x: torch.Tensor, group, link: GradAllReduce) -> torch.Tensor:
    """copy_to_tp whose backward all-reduce is asynchronous; `x` must come from `await_tp_grad(..., link)`."""
    return x if group is None else _CopyToTPAsync.apply(x, group, link)


def all_reduce_no_grad(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a statistic that needs no gradient path (the loss's max, sum-exp, target logit)."""
    return _all_reduce(t, group, op=op, tag="loss_all_reduce")


@contextmanager
def no_comm_log():
    saved, CommLog._active = CommLog._active, None
    try:
        yield
    finally:
        CommLog._active = saved
