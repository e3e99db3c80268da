"""Per-layer figures the layout search adds up: each pipeline layer's parameters on every tensor-parallel rank and
its forward FLOPs per sentence pair.

The parameters are counted on the blocks training really builds (`stage_build.build_stage_modules` on torch's meta
device), as plan.py counts them, but for a model cut to at most three encoder and three decoder layers: the first,
a middle and the last block of each kind are all that can differ (the last encoder block carries the final
LayerNorm), so a 96-layer model costs what a 6-layer one does, once per tensor-parallel size. FLOPs are
`model.costs.layer_forward_flops`, which is linear in the pairs of a micro-batch: one pair's, scaled by the caller.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from model.config import ModelConfig, ParallelConfig
from model.costs import layer_forward_flops
from model.placement import blocks_pipeline_func


@dataclass(frozen=True)
class LayerFigures:
    names: tuple[str, ...]  # embeddings, encoder.0…, decoder.0…, head: stage_build.layer_names' order
    params: np.ndarray  # (TP ranks, layers): the parameters each TP rank holds of each layer
    flops_per_pair: np.ndarray  # (layers,): forward FLOPs of one padded pair on one TP rank
    encoders: int
    tensors: np.ndarray  # (layers,): parameter tensors of each layer (ZeRO 3 gathers them one by one)
    _ranges: dict = field(default_factory=dict, compare=False, repr=False)

    def rank_params(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(parameters, the largest block's) of each distinct TP rank holding layers lo..hi-1."""
        key = (lo, hi)
        if key not in self._ranges:
            blocks = self.params[:, max(lo, 1) : min(hi, len(self.names) - 1)]
            largest = blocks.max(axis=1) if blocks.shape[1] else np.zeros(len(self.params), dtype=np.int64)
            self._ranges[key] = sorted(
                {(int(n), int(b)) for n, b in zip(self.params[:, lo:hi].sum(axis=1), largest, strict=True)}
            )
        return self._ranges[key]

    def stage_params(self, lo: int, hi: int) -> int:
        """Parameters of the largest TP rank of a stage holding layers lo..hi-1 (what plan.py reports)."""
        return max(n for n, _ in self.rank_params(lo, hi))

    def composition(self, lo: int, hi: int) -> tuple:
        """What a stage's compute, communication and activations depend on: embeddings, encoder blocks (and whether
        the last, with its final LayerNorm, is one), decoder blocks (and whether the last), head."""
        key = ("composition", lo, hi)
        if key not in self._ranges:
            e, n = self.encoders, len(self.names) - 2
            enc = max(0, min(hi - 1, e) - max(lo, 1) + 1)
            dec = max(0, min(hi - 1, n) - max(lo, e + 1) + 1)
            self._ranges[key] = (lo == 0, enc, lo <= e < hi, dec, lo <= n < hi, hi == n + 2)
        return self._ranges[key]


def _representative(kind: str, i: int, count: int, cut: int) -> str:
    """The layer of the cut model (`cut` layers of this kind) that layer i of `count` has the parameters of."""
    if i == 0:
        return f"{kind}.0"
    if i == count - 1:
        return f"{kind}.{cut - 1}"
    return f"{kind}.1"


def _no_init():
    """A torch function mode under which weight initialisation and copies do nothing: counting parameters needs
    shapes only, and torch runs a meta tensor's normal_() or clone() through its Python decompositions (3× the
    build time, and seconds importing sympy for the first)."""
    import torch
    from torch.overrides import TorchFunctionMode

    skip = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_, torch.Tensor.clone}

    class NoInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return args[0] if func in skip else func(*args, **(kwargs or {}))

    return NoInit()


def layer_figures(model: ModelConfig, tp: int, vocab_emb_dp: bool, pipelined: bool) -> LayerFigures:
    """The figures at tensor-parallel size `tp`. `pipelined`: whether stages are split (a shared table then has a
    copy on the last stage, which one process shares with the embeddings; without one nothing differs)."""
    return _layer_figures(model, tp, vocab_emb_dp, pipelined and model.share_embeddings)


@functools.lru_cache(maxsize=256)
def _layer_figures(model: ModelConfig, tp: int, vocab_emb_dp: bool, pipelined: bool) -> LayerFigures:
    from training.plan.stage_build import build_stage_modules, count_params, layer_names

    enc, dec = min(model.encoder_layers, 3), min(model.decoder_layers, 3)
    cut = model.replace(encoder_layers=enc, decoder_layers=dec)
    stages = 2 if pipelined else 1
    parallel = ParallelConfig(model_parallel=tp, vocab_emb_dp=vocab_emb_dp, pipeline_stage=stages)
    func = blocks_pipeline_func([enc, dec]) if pipelined else None  # encoders on stage 0, decoders on stage 1
    per_rank, tensor_counts = [], {}
    # TP ranks hold equal slices (heads, FFN columns and vocabulary rows are divided evenly: validate_layout and
    # the padded vocabulary); the first and the last are built, where an uneven remainder would show
    for r in sorted({0, tp - 1}):
        counts: dict[str, int] = {}
        for k in range(stages):
            with _no_init():
                modules = build_stage_modules(cut, parallel, k, r, func)
                counts.update(count_params(modules))
                tensor_counts.update({name: len(list(m.parameters())) for name, m in modules})
        per_rank.append(counts)
    names = tuple(layer_names(model))
    source = []
    for name in names:
        kind, _, index = name.partition(".")
        if not index:
            source.append(name)
        else:
            count, cut_count = (model.encoder_layers, enc) if kind == "encoder" else (model.decoder_layers, dec)
            source.append(_representative(kind, int(index), count, cut_count))
    params = np.array([[counts[s] for s in source] for counts in per_rank], dtype=np.int64)
    flops = np.array([layer_forward_flops(model, name, 1, model.src_len, model.tgt_len, tp) for name in names])
    tensors = np.array([tensor_counts[s] for s in source], dtype=np.int64)
    return LayerFigures(names, params, flops, model.encoder_layers, tensors)
