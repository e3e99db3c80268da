"""The layouts `plan.py --search` considers, and those it rejects before predicting anything.

Every (tp, pp, dp) whose product is the world; every micro-batch count that divides the batch (the global batch, or
batch_multiple for token batches); recompute off and on; with tp > 1 the word tables replicated or split
(vocab_emb_dp) and interleaving (2 or 4 parts, where the micro-batch divides); ZeRO 0-3 where dp > 1 (it shards
nothing at dp 1). Stage splits are the search's (training.plan.stage_split). Whether a layout may run is decided by
`model.config.layout_errors` — THE layout rules, the sentences train.py would print — so a rejection reads as
train.py's own refusal; the search adds one rule of its own: a tensor-parallel group inside one node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from model.config import ParallelConfig, layout_errors
from training.plan.search_setting import Setting

INTERLEAVES = (2, 4)  # MicroBatchInterleaved parts tried with tp > 1 (1 is always tried)


@dataclass(frozen=True)
class Layout:
    """One layout: what a recipe's "parallel" section says (the seed's names)."""

    model_parallel: int
    pipeline_stage: int
    data_parallel: int
    zero_stage: int = 0
    micro_batch_num: int = 1
    recompute: bool = False
    vocab_emb_dp: bool = True
    interleave_num: int = 1
    pipeline_func: str = "seed"

    def parallel(self, gradient_aggregation_group: int = 4) -> ParallelConfig:
        return ParallelConfig(
            data_parallel=self.data_parallel,
            model_parallel=self.model_parallel,
            pipeline_stage=self.pipeline_stage,
            micro_batch_num=self.micro_batch_num,
            optimizer_shard=self.zero_stage > 0,
            zero_stage=self.zero_stage,
            gradient_aggregation_group=gradient_aggregation_group,
            recompute=self.recompute,
            vocab_emb_dp=self.vocab_emb_dp,
            interleave_num=self.interleave_num,
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        """tp2 pp2 dp4 zero1 mb4 rc vocab-split il2 blocks:3,5 — the table's layout column."""
        parts = [
            f"tp{self.model_parallel}",
            f"pp{self.pipeline_stage}",
            f"dp{self.data_parallel}",
            f"zero{self.zero_stage}",
            f"mb{self.micro_batch_num}",
        ]
        parts += ["rc"] if self.recompute else []
        parts += ["vocab-split"] if not self.vocab_emb_dp and self.model_parallel > 1 else []
        parts += [f"il{self.interleave_num}"] if self.interleave_num > 1 else []
        parts += [self.pipeline_func] if self.pipeline_stage > 1 and self.pipeline_func != "seed" else []
        return " ".join(parts)


@dataclass(frozen=True)
class Group:
    """Layouts that differ only in ZeRO stage and stage split: their stages compute the same."""

    base: Layout  # zero 0, the recipe's split

    def zero_stages(self) -> tuple[list[int], list[int]]:
        """(stages to evaluate, stages DeepSpeed refuses here: rejected with layout_errors' reason)."""
        if self.base.data_parallel == 1:
            return [0], []
        if self.base.pipeline_stage > 1:
            return [0, 1], [2, 3]
        return [0, 1, 2, 3], []


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def errors(layout: Layout, setting: Setting) -> list[str]:
    """THE layout rules (model.config.layout_errors) for this layout at the setting's world and batch."""
    unit, name = setting.batch_unit
    return layout_errors(
        layout.parallel(setting.cfg.parallel.gradient_aggregation_group), setting.model, setting.world, unit, name
    )


def tp_crosses_nodes(tp: int, setting: Setting) -> bool:
    """Whether some group of tp consecutive ranks spans two nodes (rank numbering: cluster.rank_nodes)."""
    return any(setting.node_of(r) != setting.node_of(r + tp - 1) for r in range(0, setting.world, tp))


def _tp_pp_rejection(tp: int, pp: int, setting: Setting) -> tuple[Layout, str] | None:
    """A reason every layout of this (tp, pp) fails for, or None (then each variant is checked on its own)."""
    dp = setting.world // tp // pp
    # the variant most likely to pass: a shared table needs split embeddings at tp > 1 (each variant is checked)
    base = Layout(tp, pp, dp, vocab_emb_dp=tp == 1 or not setting.model.share_embeddings)
    found = errors(base, setting)
    if tp > 1 and tp_crosses_nodes(tp, setting):
        found = found + [
            f"model_parallel={tp} spans nodes ({setting.per_node} ranks per node): tensor-parallel "
            f"all-reduces run in every layer and stay inside a node (NVLink), as in Megatron"
        ]
    return (base, "; ".join(found)) if found else None


def _variants(tp: int, pp: int, dp: int, unit: int, setting: Setting) -> Iterator[Layout]:
    """Every micro-batch count, recompute, vocab_emb_dp and interleave of one (tp, pp, dp)."""
    teds = (True, False) if tp > 1 else (True,)
    func = (setting.cfg.parallel.pipeline_func or "seed") if pp > 1 else "seed"
    for mbn in divisors(unit // dp):
        micro = setting.batch // (dp * mbn)
        parts = [1] + ([n for n in INTERLEAVES if micro % n == 0 and (unit // dp // mbn) % n == 0] if tp > 1 else [])
        for recompute in (False, True):
            for ved in teds:
                for il in parts:
                    yield Layout(tp, pp, dp, 0, mbn, recompute, ved, il, func)


def enumerate_space(setting: Setting) -> tuple[list[Group], list[tuple[Layout, str]]]:
    """(the groups to predict, the layouts rejected by the rules with their reasons)."""
    groups, rejected = [], []
    unit, _ = setting.batch_unit
    for tp in divisors(setting.world):
        for pp in divisors(setting.world // tp):
            dp = setting.world // tp // pp
            refused = _tp_pp_rejection(tp, pp, setting)
            if refused:
                rejected.append(refused)
                continue
            for layout in _variants(tp, pp, dp, unit, setting):
                found = errors(layout, setting)
                if found:
                    rejected.append((layout, "; ".join(found)))
                else:
                    groups.append(Group(layout))
    return groups, rejected
