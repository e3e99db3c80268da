"""Model sizes and the parallel layout, with every constraint checked in one place before any process group exists.

`ParallelConfig` keeps the MindSpore seed's names and defaults (`TransformerOpParallelConfig`): data_parallel,
model_parallel, pipeline_stage, micro_batch_num, optimizer_shard, gradient_aggregation_group, recompute,
vocab_emb_dp, and its sub-views `dp_mp_config` / `embedding_dp_mp_config`. `validate_layout` is the only place that
decides whether a (model, layout, world, batch) combination can run; its error lists every degree and what would fit,
so scripts, recipes and tests never re-check the arithmetic themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.errors import UserError


class ConfigError(UserError):
    """A parallel layout or model size that cannot run; the message names the value and what would fit."""


# The most positions a source or target may have (src_len / tgt_len). Attention with a padding mask computes, and
# for the backward pass keeps, length² fp32 scores per head and sequence: 1 GiB at 16,384, so a single sentence pair
# of 8 heads already needs 8 GiB per layer there — 16 times fairseq's default limit of 1,024 positions, and far
# beyond any sentence (WMT training uses 128-256). A longer length is a typo (a 100,000 asked torch for 2.5 TB),
# refused in one line by train.py's flags (training.config.flags) before anything is built.
MAX_POSITIONS = 16384


@dataclass(frozen=True)
class OpParallelConfig:
    """The seed's `OpParallelConfig`: the (dp, mp) pair an operator is sharded over."""

    data_parallel: int = 1
    model_parallel: int = 1


@dataclass(frozen=True)
class EmbeddingOpParallelConfig(OpParallelConfig):
    """The seed's `EmbeddingOpParallelConfig`: vocab_emb_dp=True replicates the table (data-parallel lookup),
    False splits its rows over the model-parallel ranks."""

    vocab_emb_dp: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    """The seed's `TransformerOpParallelConfig`, same names and defaults."""

    data_parallel: int = 1
    model_parallel: int = 1
    pipeline_stage: int = 1
    micro_batch_num: int = 1
    optimizer_shard: bool = False
    gradient_aggregation_group: int = 4
    recompute: bool = False
    vocab_emb_dp: bool = True
    # Beyond the seed: the ZeRO stage when optimizer_shard is on (1 is the only one DeepSpeed allows with pipelining).
    zero_stage: int | None = None
    # The seed's `nn.MicroBatchInterleaved(net, interleave_num)`: each micro-batch runs as this many batch parts whose
    # TP communication overlaps each other's compute (model.interleave); 1 = off.
    interleave_num: int = 1

    @property
    def dp_mp_config(self) -> OpParallelConfig:
        return OpParallelConfig(self.data_parallel, self.model_parallel)

    @property
    def embedding_dp_mp_config(self) -> EmbeddingOpParallelConfig:
        return EmbeddingOpParallelConfig(self.data_parallel, self.model_parallel, self.vocab_emb_dp)

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.model_parallel * self.pipeline_stage

    @property
    def effective_zero_stage(self) -> int:
        if self.zero_stage is not None:
            return self.zero_stage
        return 1 if self.optimizer_shard else 0

    def replace(self, **changes) -> ParallelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_world(cls, world_size: int, model_parallel: int = 1, pipeline_stage: int = 1, **kw) -> ParallelConfig:
        """dp derived as world // mp // pipeline_stage, as the seed's train.py does; validate() says if it doesn't
        fit."""
        dp = max(world_size // max(model_parallel, 1) // max(pipeline_stage, 1), 1)
        return cls(data_parallel=dp, model_parallel=model_parallel, pipeline_stage=pipeline_stage, **kw)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the encoder-decoder Transformer (the seed's defaults: 8 heads, FFN = hidden size, no bias in head)."""

    vocab_size: int = 20000
    d_model: int = 128
    num_heads: int = 8
    ffn_size: int = 0  # 0 = d_model, as the seed's `ffn_hidden_size=hidden_size`
    encoder_layers: int = 1
    decoder_layers: int = 1
    src_len: int = 10
    tgt_len: int = 10
    dropout: float = 0.1  # hidden (residual/embedding) dropout
    attention_dropout: float = 0.1
    label_smoothing: float = 0.0
    pad_id: int = 0
    init_std: float = 0.02
    # one table for source words, target words and the output projection (a joint vocabulary)
    share_embeddings: bool = False

    @property
    def ffn(self) -> int:
        return self.ffn_size or self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_blocks(self) -> int:
        """Blocks the pipeline may place: encoder layers then decoder layers (embeddings/head ride along)."""
        return self.encoder_layers + self.decoder_layers

    def padded_vocab(self, model_parallel: int) -> int:
        """Vocab rounded up to a multiple of mp; the extra rows are masked out of the softmax, so loss is exact."""
        return -(-self.vocab_size // model_parallel) * model_parallel

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _or_list(items: list) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _nearest_multiples(value: int, unit: int) -> list[int]:
    """The multiples of `unit` just below and just above `value` (the below one only when positive)."""
    below = value // unit * unit
    return [b for b in (below, below + unit) if b >= unit]


def batch_errors(p: ParallelConfig, global_batch: int, name: str = "batch_size") -> list[str]:
    """What is wrong with cutting `global_batch` into dp slices, micro-batches and interleaved parts (empty: fine).
    `name`: batch_size, or batch_multiple for token batches (whose sizes are multiples of it)."""
    per = p.data_parallel * p.micro_batch_num
    if global_batch < 1 or global_batch % per:
        what = "global batch_size" if name == "batch_size" else name
        return [
            f"{what}={global_batch} is not divisible by data_parallel×micro_batch_num = "
            f"{p.data_parallel}×{p.micro_batch_num} = {per} (try {name} "
            f"{_or_list(_nearest_multiples(global_batch, per))})"
        ]
    micro = global_batch // per
    if p.interleave_num < 1 or micro % p.interleave_num == 0:
        return []
    ok = [d for d in _divisors(micro) if d <= max(p.interleave_num, 8)]
    return [
        f"interleave_num={p.interleave_num} does not divide the micro-batch of {micro} samples per rank "
        f"({name} {global_batch} / (data_parallel {p.data_parallel} × micro_batch_num {p.micro_batch_num})):"
        f" use interleave_num {_or_list(ok)}, or a {name} that {p.interleave_num} × {per} divides"
    ]


def size_errors(p: ParallelConfig, m: ModelConfig) -> list[str]:
    """The degrees and sizes below 1, and weights too large for any device (nothing else about a layout is worth
    checking while one is)."""
    errors = [
        f"{name}={getattr(p, name)} must be >= 1"
        for name in (
            "data_parallel",
            "model_parallel",
            "pipeline_stage",
            "micro_batch_num",
            "gradient_aggregation_group",
            "interleave_num",
        )
        if getattr(p, name) < 1
    ]
    errors += [
        f"{name}={getattr(m, name)} must be >= 1"
        for name in ("vocab_size", "d_model", "num_heads", "src_len", "tgt_len")
        if getattr(m, name) < 1
    ]
    if m.encoder_layers < 1 or m.decoder_layers < 1:
        errors.append(f"encoder_layers={m.encoder_layers} decoder_layers={m.decoder_layers}: both must be >= 1")
    if not errors:
        errors += tensor_size_errors(m)
    return errors


MAX_TENSOR_ELEMENTS = 2**48  # 256 T elements (1 PiB in fp32): far above any device, far below int64


def tensor_size_errors(m: ModelConfig) -> list[str]:
    """The model's largest weights, when one has more elements than any device could hold: torch's own size
    arithmetic overflows int64 first (--d_model 1000000000 traced back in plan.py)."""
    largest = {
        "the fused q/k/v weight (3·d_model × d_model)": 3 * m.d_model * m.d_model,
        "the feed-forward weight (ffn_size × d_model)": m.ffn * m.d_model,
        "the embedding table (vocab_size × d_model)": m.vocab_size * m.d_model,
        "the positions (max(src_len, tgt_len) × d_model)": max(m.src_len, m.tgt_len) * m.d_model,
    }
    return [
        f"{what} would have {n:.3g} elements (d_model={m.d_model}, ffn_size={m.ffn}, vocab_size={m.vocab_size}): "
        f"more than {MAX_TENSOR_ELEMENTS:.3g}, beyond any device; choose smaller sizes"
        for what, n in largest.items()
        if n > MAX_TENSOR_ELEMENTS
    ]


def layout_errors(
    p: ParallelConfig,
    m: ModelConfig,
    world_size: int | None = None,
    global_batch: int | None = None,
    batch_name: str = "batch_size",
) -> list[str]:
    """Every rule the (model, layout, world, batch) combination breaks, as sentences (empty: it can run)."""
    errors = size_errors(p, m)
    if errors:
        return errors

    if world_size is not None and p.world_size != world_size:
        errors.append(
            f"data_parallel×model_parallel×pipeline_stage = {p.data_parallel}×{p.model_parallel}×"
            f"{p.pipeline_stage} = {p.world_size} but the world has {world_size} processes"
        )
    if m.d_model % m.num_heads:
        errors.append(f"d_model={m.d_model} is not divisible by num_heads={m.num_heads}")
    if m.num_heads % p.model_parallel:
        ok = [d for d in _divisors(m.num_heads)]
        errors.append(
            f"num_heads={m.num_heads} is not divisible by model_parallel={p.model_parallel} "
            f"(mp must divide the heads: one of {ok})"
        )
    if m.ffn % p.model_parallel:
        errors.append(f"FFN size={m.ffn} is not divisible by model_parallel={p.model_parallel}")
    if p.pipeline_stage > m.num_blocks:
        errors.append(
            f"pipeline_stage={p.pipeline_stage} > {m.num_blocks} blocks (encoder_layers={m.encoder_layers}"
            f" + decoder_layers={m.decoder_layers}): every stage needs at least one block"
        )
    if global_batch is not None:
        errors += batch_errors(p, global_batch, batch_name)
    zero = p.effective_zero_stage
    if zero not in (0, 1, 2, 3):
        errors.append(f"zero_stage={zero} must be 0, 1, 2 or 3")
    elif zero >= 2 and p.pipeline_stage > 1:
        errors.append(
            f"ZeRO stage {zero} cannot be combined with pipeline_stage={p.pipeline_stage}: DeepSpeed's "
            f"pipeline engine supports ZeRO stage 0 or 1 only (use optimizer_shard / zero_stage 1, "
            f"or pipeline_stage=1 for ZeRO 2/3)"
        )
    if not 0.0 <= m.dropout < 1.0 or not 0.0 <= m.attention_dropout < 1.0:
        errors.append(f"dropout={m.dropout} / attention_dropout={m.attention_dropout} must be in [0, 1)")
    if not 0.0 <= m.label_smoothing < 1.0:
        errors.append(f"label_smoothing={m.label_smoothing} must be in [0, 1)")
    if m.share_embeddings and p.model_parallel > 1 and p.vocab_emb_dp:
        errors.append(
            f"share_embeddings with model_parallel={p.model_parallel} needs vocab_emb_dp=false: the shared "
            f"table is the output projection, which is split by vocabulary rows over the mp ranks"
        )
    return errors


def suggest_layouts(
    p: ParallelConfig,
    model: ModelConfig,
    world_size: int,
    global_batch: int | None = None,
    batch_name: str = "batch_size",
    limit: int = 6,
) -> list[str]:
    """Other layouts (dp, mp, pp) of `world_size` processes that pass every rule with the rest of `p` (micro-batches,
    ZeRO, interleaving) unchanged, most model-parallel first: each candidate goes through `layout_errors` itself, so
    a suggestion can never fail, and the layout that just failed is never one of them."""
    out = []
    for mp in sorted(_divisors(world_size), reverse=True):
        for pp in _divisors(world_size // mp):
            dp = world_size // mp // pp
            if (dp, mp, pp) == (p.data_parallel, p.model_parallel, p.pipeline_stage):
                continue
            candidate = p.replace(data_parallel=dp, model_parallel=mp, pipeline_stage=pp)
            if not layout_errors(candidate, model, world_size, global_batch, batch_name):
                out.append(f"dp={dp} mp={mp} pp={pp}")
    return out[:limit]


def validate_layout(
    parallel: ParallelConfig,
    model: ModelConfig,
    world_size: int | None = None,
    global_batch: int | None = None,
    batch_name: str = "batch_size",
) -> None:
    """Check every constraint; raise ConfigError listing all that fail, the degrees, and layouts that would fit.
    `global_batch`: the global batch size, or (batch_name "batch_multiple") what token batches' sizes are a multiple
    of."""
    p, m = parallel, model
    errors = layout_errors(p, m, world_size, global_batch, batch_name)
    if not errors:
        return
    if size_errors(p, m):
        raise ConfigError("; ".join(errors))  # sizes below 1: nothing else is worth checking
    zero = p.effective_zero_stage
    degrees = (
        f"[dp={p.data_parallel} mp={p.model_parallel} pp={p.pipeline_stage} "
        f"micro_batch_num={p.micro_batch_num} zero={zero}"
        + (f" interleave_num={p.interleave_num}]" if p.interleave_num != 1 else "]")
    )
    msg = "invalid parallel layout " + degrees + ": " + "; ".join(errors)
    if world_size is not None:
        fits = suggest_layouts(p, m, world_size, global_batch, batch_name)
        msg += (
            f". Layouts that fit {world_size} processes: {', '.join(fits)}"
            if fits
            else f". No other layout of {world_size} processes fits this model and these settings: change "
            f"what the message names"
        )
    raise ConfigError(msg)
