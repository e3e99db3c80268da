"""The seed's encoder-decoder Transformer as a list of blocks, tensor-parallel inside each block.

    Embeddings      src/tgt word (vocab-parallel) + position embeddings, add, dropout    (the seed's EmbeddingLayer)
    EncoderLayer×E  pre-LN self-attention + MLP; the last one applies the encoder's final LayerNorm
    DecoderLayer×D  pre-LN causal self-attention, cross-attention on the encoder memory, MLP
    Head            final LayerNorm + vocab-parallel projection (the seed's Linear head, no bias)

Blocks pass tuples so DeepSpeed's PipelineModule can cut between any two of them: encoder blocks carry
(src_h, tgt_h, src_ids, tgt_ids), decoder blocks (tgt_h, memory, src_ids, tgt_ids[, memory_tp]); float tensors carry
gradients, ids travel as integers and masks are rebuilt from them (between pipeline stages the two hidden tensors
travel joined into one: model.pipeline). Heads are split over TP ranks; per encoder layer
the forward has 2 all-reduces (attention out, MLP out) and the backward 2 (their inputs), per decoder layer 3 and 3.
The decoder memory enters the TP region once per pipeline stage (`memory_tp`), so its gradient — partial on each TP
rank, summed over every cross-attention of the stage — is all-reduced once per stage, not once per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model import interleave
from model.config import EmbeddingOpParallelConfig, ModelConfig, OpParallelConfig, ParallelConfig
from model.packing import Packing
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from model.parallel.mappings import copy_to_tp
from model.parallel.random import RNG, block_generator, checkpoint
from model.parallel.topology import ParallelContext
from model.placement import BlockPlacement, in_one_process, place_blocks


def _key_padding(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    return (ids != pad_id)[:, None, None, :]  # [B, 1, 1, S] True = attend


def _padded(rows: torch.Tensor, pack: Packing | None) -> torch.Tensor:
    return rows if pack is None else pack.unpack(rows)


# The decoder's packed self-attention in training is `is_causal` with no mask: rows are right-padded, so a real query
# sees only real keys under causality, and PAD queries are dropped by `pack`; no mask tensor keeps CUDA's flash kernel
# eligible (a mask rules it out). Bit-identical to the causal & key-padding mask in fp32 on CPU, dropout included
# (tests/test_sync_count.py). Encoder and cross-attention keep their key-padding masks (memory-efficient kernel).
CAUSAL_PACKED = None


def _causal(length: int, device, past: int = 0) -> torch.Tensor:
    """[T, past+T]: query i (position past+i) sees keys 0..past+i; past > 0 when earlier keys come from a cache."""
    return torch.ones(length, past + length, dtype=torch.bool, device=device).tril(past)


def shape_agnostic_attention() -> None:
    """Take cuDNN's attention out of torch's choice, for the process (it matters on CUDA only). On Hopper torch
    tries cuDNN's kernel first, and cuDNN builds an execution plan for each new input shape — token batches bring a
    new shape almost every step. On an H200 (GPU_RESULTS.md, 2026-11-28) transformer-big bf16 at 25k tokens took
    238 ms a step with it and 114 ms without (slowest step 541 → 134 ms); flash and memory-efficient kernels take
    any shape. Every attention layer built calls this, so training, decoding and the benchmarks all get it."""
    torch.backends.cuda.enable_cudnn_sdp(False)


class ParallelAttention(nn.Module):
    """Multi-head attention with this rank's heads. Self-attention fuses QKV (serial row layout: head, {q,k,v},
    head_dim, so a contiguous shard is whole heads); cross-attention has Q on the decoder and fused KV on memory.

    `cache` (incremental decoding, `model.inference.KVCache`): self-attention appends this call's keys/values to
    the cached ones and attends over all of them; cross-attention projects the memory once and reuses it.

    `pack` (training, `model.packing`): x holds the non-PAD tokens [N, d] of a padded batch, and so does the
    result; the projections run on those tokens only and the attention itself on the padded layout (zeros at PAD,
    hidden by the key-padding mask). `memory_pack` does the same for the memory's keys/values."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, gen: torch.Generator, cross: bool):
        super().__init__()
        shape_agnostic_attention()
        d, self.ctx, self.cross = cfg.d_model, ctx, cross
        self.heads = cfg.num_heads // ctx.tp_size
        self.head_dim, self.p = cfg.head_dim, cfg.attention_dropout
        std = cfg.init_std
        if cross:
            self.q = ColumnParallelLinear(d, d, ctx, input_is_copied=True, std=std, gen=gen)
            self.kv = ColumnParallelLinear(d, 2 * d, ctx, input_is_copied=True, std=std, gen=gen)
        else:
            self.qkv = ColumnParallelLinear(d, 3 * d, ctx, input_is_copied=True, std=std, gen=gen)
        self.out = RowParallelLinear(d, d, ctx, std=std, gen=gen)

    def _split(self, t: torch.Tensor, parts: int):
        b, s, _ = t.shape
        t = t.view(b, s, self.heads, parts, self.head_dim).permute(3, 0, 2, 1, 4)  # parts, B, h, S, hd
        return t.unbind(0)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        memory_tp: torch.Tensor | None = None,
        cache=None,
        pack: Packing | None = None,
        memory_pack: Packing | None = None,
    ):
        return self.out(self.attend(copy_to_tp(x, self.ctx.tp_group), mask, memory_tp, cache, pack, memory_pack))

    def attend(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        memory_tp: torch.Tensor | None = None,
        cache=None,
        pack: Packing | None = None,
        memory_pack: Packing | None = None,
    ):
        """This rank's heads on an input already in the TP region: [B, S, heads·head_dim] (packed: [N, ...]), the
        out-projection's input shard. `mask` None: causal self-attention (`CAUSAL_PACKED`)."""
        if self.cross:
            (q,) = self._split(_padded(self.q(x), pack), 1)
            if cache is not None and cache.keys is not None:
                k, v = cache.keys, cache.values
            else:
                mem = memory_tp if memory_pack is None else memory_pack.pack(memory_tp)
                k, v = self._split(_padded(self.kv(mem), memory_pack), 2)
                if cache is not None:
                    cache.append(k, v)
        else:
            q, k, v = self._split(_padded(self.qkv(x), pack), 3)
            if cache is not None:
                k, v = cache.append(k, v)
        p = self.p if self.training else 0.0
        with RNG.fork():  # these heads are this rank's: per-TP-rank dropout stream
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None)
        b, _, s, _ = o.shape
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return o if pack is None else pack.pack(o)


class ParallelMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, gen: torch.Generator):
        super().__init__()
        self.ctx = ctx
        self.fc1 = ColumnParallelLinear(cfg.d_model, cfg.ffn, ctx, input_is_copied=True, std=cfg.init_std, gen=gen)
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.d_model, ctx, std=cfg.init_std, gen=gen)

    def forward(self, x):
        return self.fc2(self.hidden(copy_to_tp(x, self.ctx.tp_group)))

    def hidden(self, x_tp):
        """The FFN activation shard of an input already in the TP region (fc2's input shard)."""
        return F.gelu(self.fc1(x_tp))


def word_table(
    cfg: ModelConfig,
    parallel_config: EmbeddingOpParallelConfig,
    ctx: ParallelContext,
    seed: int,
    split: bool | None = None,
) -> VocabParallelEmbedding:
    """The (first) word table, drawn first from the "embed" generator: the same values wherever it is built, so a
    pipeline's last stage can hold an exact replica of stage 0's shared table. Split over the model-parallel ranks
    unless `vocab_emb_dp` (the seed's `EmbeddingOpParallelConfig`)."""
    split = (not parallel_config.vocab_emb_dp) if split is None else split
    vp = cfg.padded_vocab(ctx.tp_size) if split else cfg.vocab_size
    return VocabParallelEmbedding(
        cfg.vocab_size, cfg.d_model, ctx, split, vp, cfg.init_std, block_generator(seed, "embed")
    )


class Embeddings(nn.Module):
    """Word + position embeddings of source and target, then dropout. With share_embeddings, one `word` table
    serves source and target (and the Head's output projection); else `src_word` and `tgt_word`. Takes the seed's
    `parallel_config.embedding_dp_mp_config`, as the seed's EmbeddingLayer does."""

    def __init__(self, cfg: ModelConfig, parallel_config: EmbeddingOpParallelConfig, ctx: ParallelContext, seed: int):
        super().__init__()
        first = word_table(cfg, parallel_config, ctx, seed)
        gen, std = first.init_generator, cfg.init_std
        if cfg.share_embeddings:
            self.word = first
        else:
            self.src_word = first
        self.src_pos = nn.Parameter(torch.empty(cfg.src_len, cfg.d_model).normal_(0, std, generator=gen))
        if not cfg.share_embeddings:
            split, vp = first.split, cfg.padded_vocab(ctx.tp_size) if first.split else cfg.vocab_size
            self.tgt_word = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, ctx, split, vp, std, gen)
        self.tgt_pos = nn.Parameter(torch.empty(cfg.tgt_len, cfg.d_model).normal_(0, std, generator=gen))
        self.drop = nn.Dropout(cfg.dropout)

    @property
    def source_table(self) -> VocabParallelEmbedding:
        return self.word if hasattr(self, "word") else self.src_word

    @property
    def target_table(self) -> VocabParallelEmbedding:
        return self.word if hasattr(self, "word") else self.tgt_word

    def embed_source(self, src_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.source_table(src_ids) + self.src_pos[: src_ids.shape[1]])

    def embed_target(self, tgt_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Target tokens at positions start, start+1, ... (start > 0: the next tokens of a cached decoder)."""
        return self.drop(self.target_table(tgt_ids) + self.tgt_pos[start : start + tgt_ids.shape[1]])

    def forward(self, inputs):
        src_ids, tgt_ids = inputs
        return self.embed_source(src_ids), self.embed_target(tgt_ids), src_ids, tgt_ids


class _Block(nn.Module):
    """A transformer layer; with recompute its activations are rebuilt in backward (exact under TP/dropout).
    With interleave_num N > 1 (and a batch N divides) it runs `_interleaved`: N batch parts, each part's TP
    communication overlapping another part's compute (`model.interleave`)."""

    recompute = False
    interleave_num = 1

    def forward(self, inputs):
        fn = self._forward
        if self.interleave_num > 1 and inputs[0].shape[0] % self.interleave_num == 0:
            fn = self._interleaved
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(fn, *inputs)
        return fn(*inputs)


class EncoderLayer(_Block):
    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ParallelContext,
        seed: int,
        index: int,
        recompute: bool = False,
        interleave_num: int = 1,
    ):
        super().__init__()
        gen = block_generator(seed, f"enc{index}")
        self.pad_id, self.recompute, self.interleave_num = cfg.pad_id, recompute, interleave_num
        self.last = index == cfg.encoder_layers - 1
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = ParallelAttention(cfg, ctx, gen, cross=False)
        self.mlp = ParallelMLP(cfg, ctx, gen)
        self.drop = nn.Dropout(cfg.dropout)
        self.final_ln = nn.LayerNorm(cfg.d_model) if self.last else None

    def _forward(self, x, tgt_h, src_ids, tgt_ids):
        pack = Packing.of(src_ids, self.pad_id)  # the source's real tokens (model.packing)
        h = pack.pack(x)
        h = h + self.drop(self.attn(self.ln1(h), _key_padding(src_ids, self.pad_id), pack=pack))
        h = h + self.drop(self.mlp(self.ln2(h)))
        return self._outputs(pack.scatter(x, h), tgt_h, src_ids, tgt_ids)

    def _interleaved(self, x, tgt_h, src_ids, tgt_ids):
        x = interleave.encoder_layer(self, x, src_ids, _key_padding(src_ids, self.pad_id))
        return self._outputs(x, tgt_h, src_ids, tgt_ids)

    def _outputs(self, x, tgt_h, src_ids, tgt_ids):
        if self.last:  # hand over to the decoder: (tgt_h, memory, ...)
            return tgt_h, self.final_ln(x), src_ids, tgt_ids
        return x, tgt_h, src_ids, tgt_ids


class DecoderLayer(_Block):
    """`last_on_stage`: drop memory_tp from the output so only replicated tensors cross a stage boundary."""

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ParallelContext,
        seed: int,
        index: int,
        last_on_stage: bool,
        recompute: bool = False,
        interleave_num: int = 1,
    ):
        super().__init__()
        gen = block_generator(seed, f"dec{index}")
        self.ctx, self.pad_id, self.recompute, self.interleave_num = ctx, cfg.pad_id, recompute, interleave_num
        self.last = index == cfg.decoder_layers - 1
        self.last_on_stage = last_on_stage
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.self_attn = ParallelAttention(cfg, ctx, gen, cross=False)
        self.cross_attn = ParallelAttention(cfg, ctx, gen, cross=True)
        self.mlp = ParallelMLP(cfg, ctx, gen)
        self.drop = nn.Dropout(cfg.dropout)

    def _forward(self, x, memory, src_ids, tgt_ids, memory_tp=None, cache=None):
        if memory_tp is None:  # first decoder layer of this stage
            memory_tp = copy_to_tp(memory, self.ctx.tp_group)
        self_cache, cross_cache = (cache.self_attn, cache.cross_attn) if cache is not None else (None, None)
        past = self_cache.length if self_cache is not None else 0  # x holds positions past.. of tgt_ids
        # teacher-forced (training): real tokens only (model.packing); incremental decoding: the new positions
        pack = memory_pack = None
        if cache is None:
            pack, memory_pack = Packing.of(tgt_ids, self.pad_id), Packing.of(src_ids, self.pad_id)
            self_mask = CAUSAL_PACKED
        else:
            self_mask = _causal(x.shape[1], x.device, past)[None, None] & _key_padding(tgt_ids, self.pad_id)
        h = x if pack is None else pack.pack(x)
        h = h + self.drop(self.self_attn(self.ln1(h), self_mask, cache=self_cache, pack=pack))
        h = h + self.drop(
            self.cross_attn(
                self.ln2(h),
                _key_padding(src_ids, self.pad_id),
                memory_tp,
                cache=cross_cache,
                pack=pack,
                memory_pack=memory_pack,
            )
        )
        h = h + self.drop(self.mlp(self.ln3(h)))
        x = h if pack is None else pack.scatter(x, h)
        return self._outputs(x, memory, src_ids, tgt_ids, memory_tp)

    def decode(self, x, memory, src_ids, tgt_ids, cache=None) -> torch.Tensor:
        """The layer outside the pipeline's tuple protocol (model.inference): x [B, L, d] holds the last L
        positions of the target prefix tgt_ids [B, T]; with a `model.inference.LayerCache` the T-L earlier
        positions come from it (and this call's keys/values are added to it), else L == T."""
        out = self._forward(x, memory, src_ids, tgt_ids, None, cache)
        return out if isinstance(out, torch.Tensor) else out[0]

    def _interleaved(self, x, memory, src_ids, tgt_ids, memory_tp=None):
        x, memory_tp = interleave.decoder_layer(
            self, x, memory, memory_tp, src_ids, tgt_ids, _key_padding(src_ids, self.pad_id)
        )
        return self._outputs(x, memory, src_ids, tgt_ids, memory_tp)

    def _outputs(self, x, memory, src_ids, tgt_ids, memory_tp):
        if self.last:  # the Head computes the logits of the target's real tokens only
            return x, tgt_ids
        if self.last_on_stage:
            return x, memory, src_ids, tgt_ids
        return x, memory, src_ids, tgt_ids, memory_tp


class Head(nn.Module):
    """Final LayerNorm and the vocab-parallel output projection; returns this rank's logits shard.

    With share_embeddings the projection is the shared word table (vocab-parallel rows, the same split as a
    column-parallel projection): in one process the Embeddings' own table (`tie`), on a pipeline's last stage a
    `replica` of stage 0's table — built from the same generator, marked `ds_pipe_replicated` (counted once in the
    gradient norm) and kept equal by summing both copies' gradients (`model.pipeline`)."""

    TIED_TO = "blocks.0.word.weight"

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig, ctx: ParallelContext, seed: int):
        super().__init__()
        self.ctx, self.pad_id = ctx, cfg.pad_id
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = self.replica = None
        self._shared = []  # the Embeddings' table, not registered here (no second name)
        if not cfg.share_embeddings:
            self.proj = ColumnParallelLinear(
                cfg.d_model,
                cfg.vocab_size,
                ctx,
                bias=False,
                std=cfg.init_std,
                gen=block_generator(seed, "head"),
                padded_out=cfg.padded_vocab(ctx.tp_size),
            )
        elif parallel.pipeline_stage > 1:
            self.replica = word_table(cfg, parallel.embedding_dp_mp_config, ctx, seed, split=ctx.tp_size > 1)
            self.replica.weight.ds_pipe_replicated = True
            self.replica.weight.tied_to = self.TIED_TO

    def tie(self, table: VocabParallelEmbedding) -> None:
        self._shared = [table]

    def forward(self, inputs):
        """x [..., d] → logits [..., V/tp]; (x [B, T, d], tgt_ids) from the last decoder layer → (logits of the
        target's real tokens [N, V/tp] (`model.packing`), tgt_ids), which `TokenLoss` reads."""
        if isinstance(inputs, tuple):
            x, tgt_ids = inputs
            return self(Packing.of(tgt_ids, self.pad_id).pack(x)), tgt_ids
        x = self.ln(inputs)
        if self.proj is not None:
            return self.proj(x)
        table = self.replica if self.replica is not None else self._shared[0]
        return F.linear(copy_to_tp(x, self.ctx.tp_group), table.weight)


class TokenLoss:
    """Σ of per-token cross-entropy over the non-PAD labels of a micro-batch, passed through `normalize` (the
    training objective's rule, `training.core.objective.GlobalTokenMean.micro_loss`, which the engine installs).
    Used as DeepSpeed's pipeline `loss_fn` and by the non-pipelined loop. Takes the seed's
    `parallel_config.dp_mp_config`, as the seed's CrossEntropyLoss does: the logits' vocabulary is split over its
    `model_parallel` ranks (this rank's slice starts at `vocab_start`); its data-parallel share is the batch split,
    normalised by `normalize`."""

    def __init__(self, cfg: ModelConfig, parallel_config: OpParallelConfig, ctx: ParallelContext, normalize=None):
        mp = parallel_config.model_parallel
        if mp != ctx.tp_size:
            raise ValueError(f"loss config model_parallel={mp} but this rank's TP group has {ctx.tp_size} ranks")
        self.cfg, self.ctx, self.normalize = cfg, ctx, normalize
        self.vocab_start = ctx.tp_rank * (cfg.padded_vocab(mp) // mp)

    def token_losses(self, logits_shard, labels):
        """Per-token losses, 0 at PAD labels: [B, T] for logits [B, T, V/tp]; for the Head's training output
        (logits of the real target tokens, tgt_ids) [N], over the labels at those tokens."""
        if isinstance(logits_shard, tuple):
            logits_shard, tgt_ids = logits_shard
            labels = Packing.of(tgt_ids, self.cfg.pad_id).pack(labels)
        return vocab_parallel_cross_entropy(
            logits_shard,
            labels,
            self.vocab_start,
            self.cfg.vocab_size,
            self.cfg.pad_id,
            self.cfg.label_smoothing,
            self.ctx.tp_group,
        )

    def __call__(self, logits_shard, labels):
        loss_sum = self.token_losses(logits_shard, labels).sum()
        return self.normalize(loss_sum) if self.normalize is not None else loss_sum


def block_specs(
    cfg: ModelConfig, parallel: ParallelConfig, ctx: ParallelContext, seed: int, placements: Sequence[BlockPlacement]
):
    """(class, kwargs) for every pipeline layer in order: Embeddings, EncoderLayer×E, DecoderLayer×D, Head.
    `placements` (model.pipeline.place_blocks: encoder blocks, then decoder blocks) say which blocks recompute and
    each block's stage, which decides a decoder layer's `last_on_stage`."""
    enc, dec = placements[: cfg.encoder_layers], placements[cfg.encoder_layers :]
    il = parallel.interleave_num
    specs = [(Embeddings, dict(cfg=cfg, parallel_config=parallel.embedding_dp_mp_config, ctx=ctx, seed=seed))]
    specs += [
        (EncoderLayer, dict(cfg=cfg, ctx=ctx, seed=seed, index=i, recompute=enc[i].recomputed, interleave_num=il))
        for i in range(cfg.encoder_layers)
    ]
    for i in range(cfg.decoder_layers):
        last_on_stage = i == cfg.decoder_layers - 1 or dec[i + 1].pipeline_stage != dec[i].pipeline_stage
        specs.append(
            (
                DecoderLayer,
                dict(
                    cfg=cfg,
                    ctx=ctx,
                    seed=seed,
                    index=i,
                    last_on_stage=last_on_stage,
                    recompute=dec[i].recomputed,
                    interleave_num=il,
                ),
            )
        )
    specs.append((Head, dict(cfg=cfg, parallel=parallel, ctx=ctx, seed=seed)))
    return specs


class Seq2SeqTransformer(nn.Module):
    """All blocks in one process (serial, or TP/DP without pipelining). forward → this rank's logits shard.
    `pipeline_func` (model.pipeline; default: the seed's) still decides which blocks recompute."""

    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelConfig | None = None,
        ctx: ParallelContext | None = None,
        seed: int = 1234,
        pipeline_func: Callable | None = None,
    ):
        super().__init__()
        ctx = ctx or ParallelContext.serial()
        parallel = parallel if parallel is not None else ParallelConfig()
        self.cfg, self.ctx = cfg, ctx
        placements = in_one_process(place_blocks(cfg, parallel, pipeline_func))
        specs = block_specs(cfg, parallel, ctx, seed, placements)
        self.blocks = nn.ModuleList(cls(**kw) for cls, kw in specs)
        if cfg.share_embeddings:
            self.blocks[-1].tie(self.blocks[0].word)
        self.loss_fn = TokenLoss(cfg, parallel.dp_mp_config, ctx)

    def forward(self, src_ids, tgt_ids):
        x = (src_ids, tgt_ids)
        for block in self.blocks:
            x = block(x)
        return x

    def logits(self, src_ids, tgt_ids) -> torch.Tensor:
        """This rank's logits shard at every target position [B, T, V/tp] (forward gives the training form: the
        real tokens' logits only). Positions after a row's end (PAD) are not computed by the decoder
        (`model.packing`): their values there are meaningless, as any model's are."""
        x = (src_ids, tgt_ids)
        for block in self.blocks[:-1]:
            x = block(x)
        return self.blocks[-1](x[0] if isinstance(x, tuple) else x)

    def loss_sum(self, src_ids, tgt_ids, labels) -> torch.Tensor:
        return self.loss_fn.token_losses(self(src_ids, tgt_ids), labels).sum()
