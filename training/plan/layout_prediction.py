"""One searched layout's prediction: its stages (a split of the blocks), their seconds and peak memory, and the step
that DeepSpeed's 1F1B schedule makes of them (training.plan.step_model has the terms, docs/layout-search.md the
model). Also the costs the split search (training.plan.stage_split) minimises, from the same terms.

Everything a stage's figures depend on is a key of the search's cache (Context.cache): the stages of a pipeline
mostly hold the same blocks, and thousands of layouts share their tensor-parallel size and micro-batch — what makes
10⁴ layouts a matter of seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model.config import ParallelConfig
from training.plan import step_model as sm
from training.plan.layer_figures import LayerFigures, layer_figures
from training.plan.layout_memory import stage_memory
from training.plan.layout_space import Layout
from training.plan.search_setting import Setting
from training.plan.stage_split import SplitCosts


@dataclass
class Prediction:
    layout: Layout
    blocks_per_stage: list[int]
    terms: sm.Terms  # the step's, by (category, factor)
    stage_peaks: list[int]  # bytes, the largest rank of each stage
    slowest_stage: int

    def seconds(self, factors: dict) -> float:
        return self.terms.seconds(factors)

    def breakdown(self, factors: dict) -> dict[str, float]:
        out = dict.fromkeys(sm.CATEGORIES, 0.0)
        for (cat, f), v in self.terms.items():
            out[cat] += v * factors[f]
        return out

    def features(self) -> dict[str, float]:
        """Seconds per factor at factor 1: the row this layout adds to a calibration fit."""
        out = dict.fromkeys(sm.FACTORS, 0.0)
        for (_, f), v in self.terms.items():
            out[f] += v
        return out

    @property
    def peak_bytes(self) -> int:
        return max(self.stage_peaks)


@dataclass(frozen=True, eq=False)
class Context:
    setting: Setting
    prior: sm.Prior
    factors: dict
    cache: dict = field(default_factory=dict)

    def memo(self, key: tuple, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


def micro_of(setting: Setting, layout: Layout) -> int:
    return setting.batch // (layout.data_parallel * layout.micro_batch_num)


def stage_bounds(counts: list[int]) -> list[tuple[int, int]]:
    """Layer index ranges (embeddings = 0, blocks 1..n, head n + 1) of the stages holding `counts` blocks each."""
    edges = np.concatenate([[0], np.cumsum(counts)]) + 1
    edges[0], edges[-1] = 0, edges[-1] + 1
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _group_key(layout: Layout) -> Layout:
    """What a stage's compute depends on (not ZeRO, not the split)."""
    return layout.with_(zero_stage=0, pipeline_func="")


def _terms_key(ctx: Context, layout: Layout) -> tuple:
    """What a stage's seconds per micro-batch depend on: the micro-batch, not how dp × micro_batch_num make it."""
    return (
        layout.model_parallel,
        layout.vocab_emb_dp,
        layout.recompute,
        layout.interleave_num,
        micro_of(ctx.setting, layout),
        layout.pipeline_stage > 1,
    )


def parallel_of(ctx: Context, layout: Layout) -> ParallelConfig:
    return ctx.memo(("parallel", layout), lambda: layout.parallel(ctx.setting.cfg.parallel.gradient_aggregation_group))


def _piece(ctx: Context, tkey: tuple, key: Layout, figs: LayerFigures, lo: int, hi: int) -> sm.Terms:
    """The additive terms of layers lo..hi-1 (step_model.stage_terms without the interleaved overlap)."""

    def make():
        micro = micro_of(ctx.setting, key)
        flops = float(figs.flops_per_pair[lo:hi].sum()) * micro
        blocks = float(figs.flops_per_pair[max(lo, 1) : min(hi, len(figs.names) - 1)].sum()) * micro
        return sm.stage_terms(ctx.setting, ctx.prior, key, figs.names[lo:hi], flops, blocks, micro, hide=False)

    return ctx.memo(("piece", tkey, lo, hi), make)


def _stage(ctx: Context, tkey: tuple, key: Layout, figs: LayerFigures, lo: int, hi: int) -> sm.Terms:
    """A stage's terms per micro-batch, without its transfers. Every term adds up layer by layer but one all-reduce
    a stage with decoder blocks makes once and the interleaved overlap (step_model), so a stage is its embeddings,
    encoder blocks, decoder blocks, the once-per-stage part and its head, each counted once per key — whatever its
    place. tests/test_layout_search.py checks it against step_model.stage_terms on the whole stage."""

    def make():
        emb, enc, _, dec, _, head = figs.composition(lo, hi)
        e = figs.encoders
        total = sm.Terms()
        if emb:
            total = total.plus(_piece(ctx, tkey, key, figs, 0, 1))
        if enc:
            total = total.plus(_piece(ctx, tkey, key, figs, 1, 2).scaled(enc))
        if dec:
            one = _piece(ctx, tkey, key, figs, e + 1, e + 2)
            if dec > 1:
                step = _piece(ctx, tkey, key, figs, e + 1, e + 3).plus(one.scaled(-1))  # a second decoder block
                one = one.plus(step.scaled(dec - 1))
            total = total.plus(one)
        if head:
            total = total.plus(_piece(ctx, tkey, key, figs, len(figs.names) - 1, len(figs.names)))
        return sm.stage_wide(total, ctx.prior, key.interleave_num)

    return ctx.memo(("stage", tkey, figs.composition(lo, hi)), make)


def _edge_kind(figs: LayerFigures, last: int) -> tuple:
    """What crosses a boundary after layer `last` depends only on its kind (model.costs.boundary_tensors)."""
    key = ("edge", last)
    if key not in figs._ranges:
        name = figs.names[last]
        figs._ranges[key] = (
            (name, False)
            if "." not in name
            else (name.split(".")[0], name in (f"encoder.{figs.encoders - 1}", figs.names[-2]))
        )
    return figs._ranges[key]


def _send(ctx: Context, tkey: tuple, key: Layout, figs: LayerFigures, last: int, spans: bool) -> sm.Terms:
    """A boundary's transfers after layer `last`."""
    return ctx.memo(
        ("send", tkey, _edge_kind(figs, last), spans),
        lambda: sm.send_terms(ctx.setting, ctx.prior, key, figs.names[last], micro_of(ctx.setting, key), spans),
    )


def _spans(setting: Setting, first: int, last: int) -> bool:
    return setting.node_of(first) != setting.node_of(last)


def _layout_spans(ctx: Context, tp: int, dp: int, pp: int) -> tuple[list[bool], list[bool]]:
    """(whether each boundary k → k + 1 crosses nodes, whether each stage's data-parallel groups do). Ranks rise
    with nodes, so a group crosses iff its ends do: a boundary's first or last pair, a DP group's first and last
    rank (model.parallel.topology: TP fastest, then DP, then PP)."""

    def make():
        s, width = ctx.setting, dp * tp
        edges = [
            _spans(s, k * width, (k + 1) * width) or _spans(s, (k + 1) * width - 1, (k + 2) * width - 1)
            for k in range(pp - 1)
        ]
        groups = [
            _spans(s, k * width, k * width + (dp - 1) * tp) or _spans(s, k * width + tp - 1, (k + 1) * width - 1)
            for k in range(pp)
        ]
        return edges, groups

    return ctx.memo(("spans", tp, dp, pp), make)


def _stage_with_edges(
    ctx: Context, tkey: tuple, key: Layout, figs: LayerFigures, bounds: list, k: int, edge_spans: list[bool]
) -> tuple:
    """(terms, seconds at the context's factors) of stage k with the transfers on its boundaries."""
    lo, hi = bounds[k]
    edges = (
        (bounds[k - 1][1] - 1, edge_spans[k - 1]) if k > 0 else None,
        (hi - 1, edge_spans[k]) if k < len(bounds) - 1 else None,
    )

    def make():
        terms = _stage(ctx, tkey, key, figs, lo, hi)
        for edge in edges:
            if edge:
                terms = terms.plus(_send(ctx, tkey, key, figs, *edge))
        return terms, terms.seconds(ctx.factors)

    kinds = tuple(edge and (_edge_kind(figs, edge[0]), edge[1]) for edge in edges)
    return ctx.memo(("edged", tkey, figs.composition(lo, hi), kinds), make)


def predict(ctx: Context, layout: Layout, counts: list[int], usable: float | None = None) -> Prediction:
    """The layout with blocks split `counts` over its stages. With `usable` (bytes), a layout whose stage does not
    fit gets its memory only (terms None): a rejection needs no step time."""
    s, L = ctx.setting, layout
    figs = layer_figures(s.model, L.model_parallel, L.vocab_emb_dp, L.pipeline_stage > 1)
    parallel = parallel_of(ctx, L)
    bounds = stage_bounds(counts)
    memory = [stage_memory(s, parallel, figs, lo, hi, k, ctx.cache) for k, (lo, hi) in enumerate(bounds)]
    peaks = [peak for peak, _, _ in memory]
    if usable is not None and max(peaks) > usable:
        return Prediction(L, list(counts), None, peaks, -1)
    tp, dp, pp, m = L.model_parallel, L.data_parallel, L.pipeline_stage, L.micro_batch_num
    key, tkey = _group_key(L), _terms_key(ctx, L)
    edge_spans, group_spans = _layout_spans(ctx, tp, dp, pp)
    stages = [_stage_with_edges(ctx, tkey, key, figs, bounds, k, edge_spans) for k in range(pp)]
    dps = {}
    for k, (_, ds_cfg, n) in enumerate(memory):
        lo, hi = bounds[k]
        tensors = int(figs.tensors[lo:hi].sum()) if L.zero_stage == 3 else 0
        if (n, group_spans[k], tensors) not in dps:
            terms = stages[k][0]
            per_micro = terms[("compute", "compute")] + terms[("recompute", "compute")]
            dterms = sm.dp_terms(s, ctx.prior, L, n, ds_cfg["zero_optimization"], group_spans[k], per_micro, tensors)
            dps[(n, group_spans[k], tensors)] = (dterms, dterms.seconds(ctx.factors))
    slow = max(range(pp), key=lambda k: stages[k][1])
    step = sm.Terms()
    for (cat, f), v in stages[slow][0].items():
        step[(cat, f)] += m * v
        if pp > 1:
            step[("bubble", f)] += (pp - 1) * v
    per_rank = max(dps.values(), key=lambda t: t[1])[0]
    per_rank[("fixed", "fixed")] = ctx.prior.step_s
    step = step.plus(per_rank)
    shared = _shared_cores(ctx, [t for t, _ in stages], per_rank, m)
    if shared is not None and shared.seconds(ctx.factors) > step.seconds(ctx.factors):
        step = shared
    return Prediction(L, list(counts), step, peaks, slow)


def _shared_cores(ctx: Context, stages: list, per_rank: sm.Terms, m: int) -> sm.Terms | None:
    """CPU ranks beyond the cores share them: a step then takes at least the work of every rank over the cores —
    each stage's ranks busy m times its time, every rank its reduction, optimizer and fixed cost (a rank waiting in
    a bubble leaves its core to another). None where each rank has a core of its own."""
    s = ctx.setting
    if s.device_type != "cpu" or s.world <= s.cores:
        return None
    busy = sm.Terms()
    for terms in stages:
        busy = busy.plus(terms.scaled(m / len(stages)))
    return busy.plus(per_rank).scaled(s.world / s.cores)


def split_costs(ctx: Context, layout: Layout, figs: LayerFigures) -> SplitCosts:
    """Per-micro-batch seconds of a stage's parts at the context's factors, from the stage terms themselves: one
    encoder block, one decoder block (and what a stage's first decoder block adds once), the embeddings, the head,
    and the transfers after each block."""
    s, key, tkey = ctx.setting, _group_key(layout), _terms_key(ctx, layout)
    n_enc, n = s.model.encoder_layers, s.model.num_blocks

    def cost(lo: int, hi: int) -> float:
        return _stage(ctx, tkey, key, figs, lo, hi).seconds(ctx.factors)

    enc = cost(1, 2)
    dec = cost(n_enc + 1, n_enc + 2)
    pair = cost(n_enc + 1, n_enc + 3) - dec if s.model.decoder_layers > 1 else dec
    block = np.array([enc] * n_enc + [pair] * (n - n_enc))
    spans = _layout_spans(ctx, layout.model_parallel, layout.data_parallel, layout.pipeline_stage)[0][0]
    send = np.array([_send(ctx, tkey, key, figs, j, spans).seconds(ctx.factors) for j in range(n + 1)])
    return SplitCosts(block, n_enc, dec - pair, cost(0, 1), cost(n + 1, n + 2), send)
