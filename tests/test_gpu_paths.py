"""What a GPU pays for, counted on a CPU (issue 23, item 3): kernel launches, host reads and copies that cost little
here and a lot on a GPU, where every host read of a device value waits for the queue of kernels to drain.

- clipping (`training.core.grad_norm.ClippingAdamW`): one fused multiply over every gradient, not one per parameter;
- the finiteness check before every save (`training.checkpoint.nonfinite`): one host read per rank, not one per
  parameter;
- the row-parallel all-reduce (`model.parallel.mappings`): in place on the partial product, no copy;
- greedy decoding's KV cache (`model.inference.KVCache`): written in place into buffers allocated once, not
  concatenated into new tensors at every token.

The packing of the real tokens (a `nonzero()` per micro-batch, part and side) is counted in tests/test_interleave.py,
greedy decoding's host reads on a GPU in tests/test_gpu.py."""

from types import SimpleNamespace

import torch

from tests.multiproc import run_ranks
from tests.op_count import OpCounter


def test_clipping_is_one_fused_multiply_not_one_per_parameter():
    """24 parameters: the clip multiplies every gradient with one `_foreach_mul_` and no per-tensor `mul_`, and the
    clipped gradients are the per-parameter loop's bit for bit."""
    from training.core.grad_norm import ClippingAdamW

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(24)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = ClippingAdamW([{"params": params}], max_norm=0.5, tp_rank=0, norm_group=None, lr=1e-3, fused=True)
    norm = torch.stack([p.grad.square().sum() for p in params]).sum().sqrt()
    coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
    want = [p.grad * coef for p in params]
    assert float(coef) < 1  # the clip acts
    with OpCounter() as ops:
        opt.step()
    assert ops.counts.get("_foreach_mul_") == 1 and not ops.counts.get("mul_"), ops.counts
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))


def _finiteness_reads(rank, world, poison):
    from common.errors import UserError
    from training.checkpoint.nonfinite import refuse_non_finite_weights

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(10)])  # 20 parameters
    if poison and rank == 1:
        model[7].bias.data[2] = float("inf")
    engine = SimpleNamespace(module=model, device=torch.device("cpu"))  # what the check reads of the engine
    with OpCounter() as ops:
        try:
            refuse_non_finite_weights(engine, 5, None)
            error = None
        except UserError as exc:
            error = str(exc)
    return ops.counts.get("_local_scalar_dense", 0), error


def test_the_finiteness_check_before_a_save_reads_the_device_once():
    """Finite weights: one host read per rank for the whole model (was one per parameter: 20 here). A rank with an
    inf: every rank refuses, that rank naming the tensor (its extra reads are on the failure path only)."""
    for reads, error in run_ranks(2, _finiteness_reads, False):
        assert reads == 1 and error is None, reads
    (_, error0), (_, error1) = run_ranks(2, _finiteness_reads, True)
    assert "step 5: the weights are not finite (7.bias on rank 1)" in error1
    assert "step 5: the weights are not finite (on another rank)" in error0


def _row_parallel_copies(rank, world):
    from model.parallel.layers import RowParallelLinear
    from tests.test_tp_layers import tp_context

    ctx = tp_context(world)
    layer = RowParallelLinear(8, 6, ctx, gen=torch.Generator().manual_seed(1))
    x = torch.randn(3, 5, 8 // world, generator=torch.Generator().manual_seed(2 + rank), requires_grad=True)
    with OpCounter() as ops:
        y = layer(x)
    y.sum().backward()  # the in-place sum does not break the backward (autograd would refuse)
    return ops.counts, y.detach(), x.grad is not None


def test_row_parallel_all_reduce_sums_in_place_without_a_copy():
    (ops, y0, grad0), (_, y1, grad1) = run_ranks(2, _row_parallel_copies)
    assert not ops.get("clone") and not ops.get("copy_"), ops
    assert torch.equal(y0, y1) and grad0 and grad1  # both ranks hold the summed output


def test_kv_cache_writes_into_buffers_allocated_once():
    """With a capacity the cache allocates its buffers at the first append and writes later positions in place:
    `keys` / `values` stay views of the same storage (no concatenation per token) and hold every position so far;
    past its capacity it still grows (by concatenation)."""
    from model.inference import KVCache

    cache, g = KVCache(capacity=6), torch.Generator().manual_seed(0)
    steps = [(torch.randn(2, 4, 1, 8, generator=g), torch.randn(2, 4, 1, 8, generator=g)) for _ in range(6)]
    storage = None
    for i, (k, v) in enumerate(steps):
        with OpCounter() as ops:
            keys, values = cache.append(k, v)
        assert not ops.counts.get("cat"), ops.counts
        storage = storage or keys.untyped_storage().data_ptr()
        assert keys.untyped_storage().data_ptr() == storage and keys.shape[2] == i + 1
        assert torch.equal(keys, torch.cat([s[0] for s in steps[: i + 1]], dim=2))
        assert torch.equal(values, torch.cat([s[1] for s in steps[: i + 1]], dim=2))
    keys, _ = cache.append(*steps[0])
    assert keys.shape[2] == 7 and cache.length == 7
