"""The seed's `nn.MicroBatchInterleaved(net, interleave_num)` for the tensor-parallel blocks: each micro-batch is cut
into N parts along the batch dimension, and one part's TP all-reduces run while another part computes.

Each residual branch of a layer (self-attention, cross-attention, MLP: x + drop(row(column(copy(ln(x)))))) runs, for
one part, in three phases separated by `yield`:

    H  wait for the previous branch's forward all-reduce, residual add, LayerNorm, `await_tp_grad`
    A  `copy_to_tp_async` and the column-parallel half (QKV/Q+KV projections and attention, or fc1 and GELU)
    B  the row-parallel partial sum, its all-reduce started (`reduce_from_tp_async`)

`run_staggered` advances part k by one phase per round, starting at round k, parts in order within a round. So
between a part's B and its next H (forward all-reduce in flight) another part runs an A or B phase, and between a
part's H and its A another part runs a B or A phase. The second matters in backward: autograd runs the nodes of
independent parts in reverse creation order, so the input-gradient all-reduce that `copy_to_tp_async`'s backward
starts is in flight while that other part's phase is differentiated, and `await_tp_grad`'s backward waits for it
only then, just before the LayerNorm's backward reads the gradient. This is Domino's idea
(deepspeed/runtime/domino: batch halves, async all-reduces, a no-op autograd node that waits in backward) for an
encoder-decoder with padding masks and cross-attention, generalised to N parts. Per layer and direction one
all-reduce has nothing to overlap with — forward the last part's last one, backward the first part's first one —
because every block starts from and returns whole tensors, so pipeline stages and recompute see the same tuples as
without interleaving.

The decoder memory enters the TP region once per stage, as before, now once per part: a part's copy is made in
its cross-attention and the parts are concatenated into the `memory_tp` the stage's next decoder layers use.

Exactness: every token's arithmetic is the one of the non-interleaved layer; only weight-gradient sums are split
into N terms (fp32 rounding). Dropout masks are drawn per part, each dropout site's parts one after the other
(part 0 first) — the order in which the non-interleaved layer draws the whole batch's mask. CPU's generator fills
a mask element by element, so there the masks are interleave_num 1's; a generator that draws per kernel launch
(CUDA's) may give other masks of the same distribution. Either way they are identical on the TP ranks and replayed
exactly by recompute.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from model.packing import Packing
from model.parallel.mappings import GradAllReduce, await_tp_grad, copy_to_tp_async, reduce_from_tp_async

Part = Generator[None, None, object]


def run_staggered(parts: list[Part]) -> list:
    """Run the generators interleaved: part k starts at round k, every live part runs one phase per round, in order.
    Returns their return values, in order."""
    results: list = [None] * len(parts)
    waiting, live = list(enumerate(parts)), []
    while waiting or live:
        if waiting:
            live.append(waiting.pop(0))
        still = []
        for k, part in live:
            try:
                next(part)
                still.append((k, part))
            except StopIteration as done:
                results[k] = done.value
        live = still
    return results


def tp_region(h: torch.Tensor, column: Callable[[torch.Tensor], torch.Tensor], row, group) -> Part:
    """row(column(copy_to_tp(h))) for one part — a column-parallel half, then a `RowParallelLinear` — with both
    collectives asynchronous: yields after H (`await_tp_grad`), A (copy and column half) and B (partial sum, its
    all-reduce started); the wait for that all-reduce opens the caller's next phase."""
    link = GradAllReduce()
    h = await_tp_grad(h, link)
    yield
    shard = column(copy_to_tp_async(h, group, link))
    yield
    pending = reduce_from_tp_async(row.partial(shard), group)
    yield
    return row.add_bias(pending.wait())


def residual_branch(x: torch.Tensor, ln, column: Callable[[torch.Tensor], torch.Tensor], row, drop, group) -> Part:
    """x + drop(row(column(copy_to_tp(ln(x))))) for one part (phases H, A, B of `tp_region`)."""
    return x + drop((yield from tp_region(ln(x), column, row, group)))


def _encoder_part(layer, x, pack: Packing, mask) -> Part:
    group = layer.attn.ctx.tp_group
    h = yield from residual_branch(
        pack.pack(x), layer.ln1, lambda t: layer.attn.attend(t, mask, pack=pack), layer.attn.out, layer.drop, group
    )
    h = yield from residual_branch(h, layer.ln2, layer.mlp.hidden, layer.mlp.fc2, layer.drop, group)
    return pack.scatter(x, h)


def encoder_layer(layer, x: torch.Tensor, src_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`EncoderLayer`'s two residual branches on `layer.interleave_num` parts; returns the whole batch."""
    n = layer.interleave_num
    # each part's real tokens (model.packing): built by the stage's first layer, before any part runs (a nonzero
    # in the middle of the staggered schedule would wait for the parts already queued), and reused by the others
    packs = Packing.parts(src_ids, layer.pad_id, n)
    return torch.cat(run_staggered([_encoder_part(layer, *p) for p in zip(x.chunk(n), packs, mask.chunk(n))]))


def _decoder_part(layer, x, memory, memory_tp, memory_pack: Packing, pack: Packing, cross_mask) -> Part:
    group = layer.ctx.tp_group
    link = None
    if memory_tp is None:  # first decoder layer of the stage: this part's memory enters here
        link = GradAllReduce()
        memory = await_tp_grad(memory, link)
    entered = [memory_tp]

    def cross(h):
        if entered[0] is None:
            entered[0] = copy_to_tp_async(memory, group, link)
        return layer.cross_attn.attend(h, cross_mask, entered[0], pack=pack, memory_pack=memory_pack)

    h = yield from residual_branch(
        pack.pack(x),
        layer.ln1,
        # mask None: causal (model.transformer.CAUSAL_PACKED)
        lambda t: layer.self_attn.attend(t, None, pack=pack),
        layer.self_attn.out,
        layer.drop,
        group,
    )
    h = yield from residual_branch(h, layer.ln2, cross, layer.cross_attn.out, layer.drop, group)
    h = yield from residual_branch(h, layer.ln3, layer.mlp.hidden, layer.mlp.fc2, layer.drop, group)
    return pack.scatter(x, h), entered[0]


def decoder_layer(
    layer,
    x: torch.Tensor,
    memory: torch.Tensor,
    memory_tp: torch.Tensor | None,
    src_ids: torch.Tensor,
    tgt_ids: torch.Tensor,
    cross_mask: torch.Tensor,
):
    """`DecoderLayer`'s three residual branches on `layer.interleave_num` parts; returns (x, memory_tp), whole batch
    (memory_tp only when the layer hands it on to the stage's next decoder layer, else None)."""
    n = layer.interleave_num
    memories = memory_tp.chunk(n) if memory_tp is not None else [None] * n
    memory_packs, packs = Packing.parts(src_ids, layer.pad_id, n), Packing.parts(tgt_ids, layer.pad_id, n)
    parts = [
        _decoder_part(layer, *p)
        for p in zip(x.chunk(n), memory.chunk(n), memories, memory_packs, packs, cross_mask.chunk(n))
    ]
    outs = run_staggered(parts)
    x = torch.cat([o[0] for o in outs])
    hands_on = not (layer.last or layer.last_on_stage)
    if not hands_on:
        return x, None
    return x, memory_tp if memory_tp is not None else torch.cat([o[1] for o in outs])
