"""Plan a run without starting it: layout, where every rank runs, what each stage holds, memory and communication.

`run_scripts/plan.py --recipe R.json (--world_size N | --hostfile H) [train.py flags]` calls `main` here. Nothing
below creates a process group, calls deepspeed.initialize or reads data: the layout goes through the same
checks train.py makes before it starts (training.config.preflight: `validate_layout`, the pipeline_func, the recipe's
DeepSpeed settings) and the `assign_stages` training uses, and every distinct (stage, TP rank) builds its real blocks
(`model.transformer.block_specs` with `ParallelContext(tp_size, tp_rank)`, no group) on torch's `meta` device —
shapes without storage — so parameter counts are those of the run, for 16 or 64 ranks in a second or two.

The figures come from the cost model, `model.costs` (its docstring has every formula); the text report is
`training.plan.report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from common.cli_args import integer, number
from common.errors import UserError
from model.config import ModelConfig, ParallelConfig
from model.costs import (
    activation_bytes,
    boundary_bytes,
    boundary_tensors,
    deepspeed_zero_stage,
    dp_bytes,
    in_flight,
    layer_forward_flops,
    tensor_bytes,
    tp_allreduces,
)
from model.placement import load_pipeline_func, pipeline_func_name, place_blocks
from training.config.flags import build_parser, given_flags, parse_args
from training.config.preflight import check_run
from training.config.sections import TrainConfig
from training.plan import advice, slurm_line, token_budget
from training.plan import memory as mem
from training.plan import speed_prediction as speed
from training.plan.cluster import Host, format_hostfile, rank_nodes, read_hostfile
from training.plan.report import compact_layers, format_plan
from training.plan.stage_build import (
    layer_names,
    rank_memory,
    stage_layers,
    stage_param_counts,
)

# ------------------------------------------------------------------------------------------------------------ plan


def resolve_world(
    world_size: int | None, hostfile: str | None, world_size_given: bool = True
) -> tuple[int, list[Host] | None]:
    """(processes, hosts): a hostfile's slots, else --world_size (or the recipe's world_size). A hostfile wins over
    the recipe's value, as a flag wins over a recipe key; a --world_size given beside it must agree."""
    hosts = read_hostfile(hostfile) if hostfile else None
    if hosts is not None:
        slots = sum(h.slots for h in hosts)
        if world_size_given and world_size is not None and world_size != slots:
            raise UserError(f"--world_size {world_size} but the hostfile {hostfile} has {slots} slots; give one")
        return slots, hosts
    if world_size is None:
        raise UserError(
            "give the world to plan for: --world_size N (processes), --hostfile H (DeepSpeed hostfile), "
            'or a recipe whose "parallel" section says "world_size"'
        )
    return world_size, None


def planned_vocab(cfg: TrainConfig) -> tuple[int, str]:
    """(the vocabulary train.py sizes the model to, where it comes from: "" for --vocab_size / the recipe's). Without
    one, train.py takes the tokenizer's: --tokenizer's file, else the BPE tokenizer it builds, of at most
    --tokenizer_vocab_size tokens — which a copied recipe (cpu-tiny) plans with, instead of asking for --vocab_size."""
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size, ""
    if cfg.model.tokenizer:
        from preprocess.tokenizer import load_tokenizer

        return load_tokenizer(cfg.model.tokenizer).get_vocab_size(with_added_tokens=True), "--tokenizer's"
    return cfg.model.tokenizer_vocab_size, "--tokenizer_vocab_size: at most this many in the tokenizer train.py builds"


def configs(cfg: TrainConfig, world_size: int, need_vocab: bool = True) -> tuple[ModelConfig, ParallelConfig]:
    """The ModelConfig / ParallelConfig train.py would build, after the checks train.py makes before it starts
    (training.config.preflight.check_run: the layout rules, the pipeline_func, the recipe's DeepSpeed settings)."""
    if cfg.model.vocab_size is None and need_vocab:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=planned_vocab(cfg)[0]))
    return check_run(cfg, world_size)


def _layout_memory(cfg: TrainConfig, model: ModelConfig, parallel: ParallelConfig, func, device_type: str) -> dict:
    """What memory depends on, for every distinct (stage, TP rank): its parameters by layer (the blocks it really
    builds, on the meta device), and the DeepSpeed config train.py would generate there (each rank sizes its
    buckets from its own gradient elements: training.core.engine.build_engine); "ds_cfg" is rank 0's."""
    from training.core.engine import deepspeed_config  # the DeepSpeed config train.py would use: checks the overrides

    counts: dict[tuple[int, int], dict[str, int]] = {}
    ds_cfgs: dict[tuple[int, int], dict] = {}
    for k in range(parallel.pipeline_stage):
        for r in range(parallel.model_parallel):
            counts[(k, r)] = stage_param_counts(model, parallel, k, r, func, seed=cfg.optimization.seed)
            ds_cfgs[(k, r)] = deepspeed_config(
                parallel,
                cfg.data.batch_size,
                cfg.parallel.precision,
                cfg.optimization.clip_grad,
                sum(counts[(k, r)].values()),
                cfg.parallel.deepspeed_overrides,
                cfg.parallel.deepspeed_config,
                device_type=device_type,
            )
    return {"counts": counts, "ds_cfgs": ds_cfgs, "ds_cfg": ds_cfgs[(0, 0)]}


def stage_activations(cfg: TrainConfig, model: ModelConfig, parallel: ParallelConfig, func) -> list[dict]:
    """Per stage: its layers and the activation estimate (per micro-batch, in flight, peak)."""
    names = layer_names(model)
    recomputed = [p.name for p in place_blocks(model, parallel, func) if p.recomputed]
    micro = cfg.data.batch_size // (parallel.data_parallel * parallel.micro_batch_num)
    out = []
    for k, idx in enumerate(stage_layers(model, parallel, func)):
        layer_list = [names[i] for i in idx]
        acts = activation_bytes(model, parallel, layer_list, micro, cfg.parallel.precision, recomputed)
        fl = in_flight(parallel, k)
        out.append(
            {
                "layers": layer_list,
                **acts,
                "in_flight": fl,
                "peak": acts["per_micro_batch"] * fl + acts["recompute_transient"],
            }
        )
    return out


def stage_measures(cfg: TrainConfig, world_size: int, func=None, device_type: str = "cuda") -> dict:
    """What the balance of a layout is judged by, per stage (each the largest over its TP ranks): "params", "peak_bytes"
    (the memory verdict's input) and "flops" (forward FLOPs of one micro-batch, model.costs.layer_forward_flops), plus
    "layer_params" / "layer_flops" by layer name. `func`: a pipeline_func object to plan with instead of the recipe's
    (training.plan.advice re-plans other splits with it). UserError for a layout that cannot run."""
    model, parallel = configs(cfg, world_size)
    func = func or load_pipeline_func(cfg.parallel.pipeline_func)
    built = _layout_memory(cfg, model, parallel, func, device_type)
    acts = stage_activations(cfg, model, parallel, func)
    pp, tp = parallel.pipeline_stage, parallel.model_parallel
    counts = built["counts"]
    peaks = [
        max(
            rank_memory(
                sum(counts[(k, r)].values()),
                counts[(k, r)],
                acts[k]["peak"],
                parallel,
                built["ds_cfgs"][(k, r)],
                cfg.parallel.precision,
            )["total_bytes"]
            for r in range(tp)
        )
        for k in range(pp)
    ]
    return _measures(model, parallel, cfg, counts, peaks, [a["layers"] for a in acts])


def _measures(
    model: ModelConfig,
    parallel: ParallelConfig,
    cfg: TrainConfig,
    counts: dict,
    peaks: list[int],
    layers: list[list[str]],
) -> dict:
    micro = cfg.data.batch_size // (parallel.data_parallel * parallel.micro_batch_num)
    tp = parallel.model_parallel
    layer_params = {
        name: max(counts[(k, r)][name] for r in range(tp)) for k, names in enumerate(layers) for name in names
    }
    layer_flops = {
        name: layer_forward_flops(model, name, micro, model.src_len, model.tgt_len, tp)
        for names in layers
        for name in names
    }
    return {
        "layers": layers,
        "params": [max(sum(counts[(k, r)].values()) for r in range(tp)) for k in range(len(layers))],
        "peak_bytes": list(peaks),
        "flops": [sum(layer_flops[n] for n in names) for names in layers],
        "layer_params": layer_params,
        "layer_flops": layer_flops,
    }


def stage_peaks(cfg: TrainConfig, world_size: int, device_type: str = "cuda") -> list[int]:
    """Each stage's largest per-rank peak in bytes (the memory verdict's input; UserError for a layout that cannot
    run)."""
    return stage_measures(cfg, world_size, device_type=device_type)["peak_bytes"]


class RankRows(Sequence):
    """plan["ranks"]: every rank's row, made when read. A rank's bytes depend only on its (stage, TP rank), so a
    world of 10⁶ ranks needs no 10⁶ dicts for the text report, which prints the ends (json.dumps: `as_json`)."""

    def __init__(self, parallel: ParallelConfig, nodes: list, memory_by: dict):
        self.tp, self.dp = parallel.model_parallel, parallel.data_parallel
        self.nodes, self.memory_by = nodes, memory_by

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        rank = range(len(self))[i]  # negative indices, and IndexError past the end
        pp, dp, tp = rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp  # model.parallel.topology
        node, host, local = self.nodes[rank]
        return {
            "rank": rank,
            "node": node,
            "host": host,
            "local_rank": local,
            "pp": pp,
            "dp": dp,
            "tp": tp,
            **self.memory_by[(pp, tp)],
        }


def as_json(plan: dict) -> str:
    def rows(obj):
        if isinstance(obj, RankRows):
            return list(obj)
        raise TypeError(f"{type(obj).__name__} in a plan")

    return json.dumps(plan, indent=1, default=rows)


def _stage_entry(
    k: int,
    layer_list: list[str],
    model,
    parallel,
    prec: str,
    micro: int,
    recomputed: list[str],
    counts: dict,
    acts: dict,
    memory_by: dict,
    ds_cfg: dict,
) -> dict:
    """Stage k of the plan: its layers and ranks, parameters, activations, peak bytes, tensor-parallel all-reduces,
    data-parallel traffic and (all but the last stage) what it sends to the next stage."""
    tp, dp, pp = parallel.model_parallel, parallel.data_parallel, parallel.pipeline_stage
    el = 2 if prec in ("fp16", "bf16") else 4
    ar = tp_allreduces(model, parallel, layer_list, micro, recomputed)
    bytes_per_micro = (sum(ar["forward"]) + sum(ar["backward"])) * el + sum(ar["loss"]) * 4
    n0 = sum(counts[(k, 0)].values())
    stage = {
        "stage": k,
        "layers": layer_list,
        "ranks": [k * dp * tp, (k + 1) * dp * tp - 1],  # TP fastest, then DP
        "params_per_rank": n0,
        "params_by_layer": counts[(k, 0)],
        "activations": {key: acts[key] for key in ("per_micro_batch", "recompute_transient", "in_flight", "peak")},
        "peak_bytes": max(memory_by[(k, r)]["total_bytes"] for r in range(tp)),
        "tp_allreduce": {
            "forward_elements": ar["forward"],
            "backward_elements": ar["backward"],
            "loss_elements": ar["loss"],
            "calls_per_micro_batch": sum(len(v) for v in ar.values()),
            "bytes_per_micro_batch": bytes_per_micro,
            "bytes_per_step": bytes_per_micro * parallel.micro_batch_num,
            "sent_per_rank_per_step": int(round(2 * (tp - 1) / tp * bytes_per_micro * parallel.micro_batch_num)),
        },
        "dp": dp_bytes(
            n0,
            prec,
            ds_cfg["zero_optimization"]["stage"],
            parallel,
            bool(ds_cfg["zero_optimization"].get("use_multi_rank_bucket_allreduce", True)),
        ),
    }
    if k < pp - 1:
        tensors = boundary_tensors(model, layer_list[-1], micro)
        for tsr in tensors:
            tsr["bytes"] = tensor_bytes(tsr, el)
        split = {key: bool(ds_cfg["pipeline"].get(key)) and tp > 1 for key in ("pipe_partitioned", "grad_partitioned")}
        fwd, bwd = boundary_bytes(tensors, el, tp, split["pipe_partitioned"], split["grad_partitioned"])
        stage["send_next"] = {
            "tensors": tensors,
            "forward_bytes_per_micro_batch": fwd,
            "backward_bytes_per_micro_batch": bwd,
            "bytes_per_step": (fwd + bwd) * parallel.micro_batch_num,
            **split,
        }
    return stage


def _memory_by_rank_kind(counts, acts_by_stage, parallel, ds_cfgs, prec) -> dict:
    """{(stage, TP rank): params and bytes}: a rank's bytes depend on those two only, so they are computed once
    each and the plan is linear in the world size."""
    return {
        (k, r): {
            "params": sum(counts[(k, r)].values()),
            **rank_memory(
                sum(counts[(k, r)].values()),
                counts[(k, r)],
                acts_by_stage[k]["peak"],
                parallel,
                ds_cfgs[(k, r)],
                prec,
            ),
        }
        for (k, r) in counts
    }


def _layout_entry(cfg: TrainConfig, parallel, func, zero: int, micro: int, nodes, world_size: int) -> dict:
    """The plan's "layout": the parallel sizes, ZeRO, the batch arithmetic, and the groups that cross nodes."""
    tp, dp, pp = parallel.model_parallel, parallel.data_parallel, parallel.pipeline_stage

    def groups_spanning_nodes(first_ranks, last_rank_of) -> int:
        # a group's ranks rise from its first to its last, and so do their nodes: it spans nodes iff its ends do
        return sum(1 for r in first_ranks if nodes[r][0] != nodes[last_rank_of(r)][0])

    tp_firsts = range(0, world_size, tp)  # (pp, dp): tp consecutive ranks
    dp_firsts = [k * dp * tp + r for k in range(pp) for r in range(tp)]  # (pp, tp): ranks tp apart
    return {
        "data_parallel": dp,
        "model_parallel": tp,
        "pipeline_stage": pp,
        "micro_batch_num": parallel.micro_batch_num,
        "zero_stage": zero,
        "zero_stage_requested": parallel.effective_zero_stage,
        "optimizer_shard": parallel.optimizer_shard,
        "recompute": parallel.recompute,
        "vocab_emb_dp": parallel.vocab_emb_dp,
        "pipeline_func": pipeline_func_name(func),
        "global_batch": cfg.data.batch_size,
        "micro_batch": micro,
        # the global batch is fixed: the per-GPU micro-batch shrinks as dp grows (said in the report)
        "micro_batch_at_dp1": cfg.data.batch_size // parallel.micro_batch_num,
        "world_at_dp1": tp * pp,
        "tp_groups_spanning_nodes": groups_spanning_nodes(tp_firsts, lambda r: r + tp - 1),
        "dp_groups_spanning_nodes": groups_spanning_nodes(dp_firsts, lambda r: r + (dp - 1) * tp),
    }


def _model_entry(cfg: TrainConfig, model, tp: int) -> dict:
    return {
        "vocab_size": model.vocab_size,
        "vocab_source": planned_vocab(cfg)[1],
        "padded_vocab": model.padded_vocab(tp),
        "d_model": model.d_model,
        "num_heads": model.num_heads,
        "ffn_size": model.ffn,
        "encoder_layers": model.encoder_layers,
        "decoder_layers": model.decoder_layers,
        "src_len": model.src_len,
        "tgt_len": model.tgt_len,
        "precision": cfg.parallel.precision,
    }


# the DeepSpeed settings the plan shows (the batch arithmetic and ZeRO), as train.py would give them
DEEPSPEED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
)


def _nodes_entry(hosts: list[Host] | None, ranks_per_node: int, world_size: int):
    if hosts is not None:
        return [{"host": h.name, "slots": h.slots} for h in hosts]
    return {"ranks_per_node": ranks_per_node, "count": -(-world_size // ranks_per_node)}


def _memory_entry(device_name: str, memory: float, verdict: list, fixes: list) -> dict:
    return {
        "device": device_name,
        "device_bytes": int(memory),
        "usable_fraction": mem.USABLE,
        "stages": verdict,
        "remedies": [f["text"] for f in fixes],
        "remedy_changes": fixes,
    }


def _memory_verdict(cfg, world_size: int, model, parallel, stages: list, memory: float, device_type: str):
    """(each stage's fit on the device, and the layouts that would fit when one does not)."""
    verdict = mem.verdict([st["peak_bytes"] for st in stages], memory)
    if all(v["fits"] for v in verdict):
        return verdict, []
    return verdict, mem.remedies(
        cfg, world_size, parallel, model.num_blocks, memory, lambda c, w: stage_peaks(c, w, device_type)
    )


def make_plan(
    cfg: TrainConfig,
    world_size: int,
    hosts: list[Host] | None = None,
    ranks_per_node: int = 8,
    device: str | None = None,
    device_memory: float | None = None,
    device_type: str = "cuda",
) -> dict:
    """Everything plan.py prints, as a dict (`as_json` writes it; "ranks" is a RankRows). `device` / `device_memory`
    (GiB): what the memory verdict compares against (default an H100); `device_type`: "cuda" (plans are for GPU
    clusters) or "cpu" (the DeepSpeed settings train.py picks on a CPU: no ZeRO overlap buffers)."""
    model, parallel = configs(cfg, world_size)
    device_name, memory = mem.device_bytes(device, device_memory)
    func = load_pipeline_func(cfg.parallel.pipeline_func)
    names = layer_names(model)
    per_stage = stage_layers(model, parallel, func)
    placements = place_blocks(model, parallel, func)
    recomputed = [p.name for p in placements if p.recomputed]
    micro = cfg.data.batch_size // (parallel.data_parallel * parallel.micro_batch_num)
    prec = cfg.parallel.precision

    # every distinct (stage, tp rank) builds its own blocks and counts their parameters
    built = _layout_memory(cfg, model, parallel, func, device_type)
    counts, ds_cfg = built["counts"], built["ds_cfg"]
    # the stage the layout line names is the one in the DeepSpeed config printed below (bf16 at ZeRO 0 runs 1)
    zero = ds_cfg["zero_optimization"]["stage"]
    acts_by_stage = stage_activations(cfg, model, parallel, func)

    nodes = rank_nodes(world_size, hosts, ranks_per_node)
    memory_by = _memory_by_rank_kind(counts, acts_by_stage, parallel, built["ds_cfgs"], prec)
    ranks = RankRows(parallel, nodes, memory_by)
    stages = [
        _stage_entry(
            k,
            [names[i] for i in idx],
            model,
            parallel,
            prec,
            micro,
            recomputed,
            counts,
            acts_by_stage[k],
            memory_by,
            ds_cfg,
        )
        for k, idx in enumerate(per_stage)
    ]

    verdict, fixes = _memory_verdict(cfg, world_size, model, parallel, stages, memory, device_type)
    measures = _measures(
        model, parallel, cfg, counts, [st["peak_bytes"] for st in stages], [st["layers"] for st in stages]
    )
    tips = advice.plan_advice(
        cfg,
        world_size,
        model,
        parallel,
        func,
        measures,
        device,
        lambda c, f: stage_measures(c, world_size, f, device_type),
    )
    return {
        "recipe": cfg.recipe,
        "world_size": world_size,
        "nodes": _nodes_entry(hosts, ranks_per_node, world_size),
        "layout": _layout_entry(cfg, parallel, func, zero, micro, nodes, world_size),
        "model": _model_entry(cfg, model, parallel.model_parallel),
        "deepspeed": {key: ds_cfg[key] for key in DEEPSPEED_KEYS},
        "blocks": [
            {"block": p.name, "stage": p.pipeline_stage, "recompute": p.recomputed, "comm_fusion": p.comm_fusion}
            for p in placements
        ],
        "stages": stages,
        "ranks": ranks,
        "memory": _memory_entry(device_name, memory, verdict, fixes),
        "advice": tips,
    }


# ------------------------------------------------------------------------------------------------------- the check


def check_line(cfg: TrainConfig, world_size: int, hosts=None) -> str:
    model, parallel = configs(cfg, world_size, need_vocab=False)
    func = load_pipeline_func(cfg.parallel.pipeline_func)
    per = stage_layers(model, parallel, func)
    names = layer_names(model)
    micro = cfg.data.batch_size // (parallel.data_parallel * parallel.micro_batch_num)
    stages = " | ".join(f"stage {k}: {compact_layers([names[i] for i in idx])}" for k, idx in enumerate(per))
    stages = f"pipeline_func {pipeline_func_name(func)}: {stages}"
    return (
        f"layout ok: {world_size} ranks = dp {parallel.data_parallel} × mp {parallel.model_parallel} × pp "
        f"{parallel.pipeline_stage}; global batch {cfg.data.batch_size} = micro {micro} × micro_batch_num "
        f"{parallel.micro_batch_num} × dp {parallel.data_parallel}; ZeRO "
        f"{deepspeed_zero_stage(parallel.effective_zero_stage, cfg.parallel.precision)}; "
        f"{stages}"
    )


# --------------------------------------------------------------------------------------------------------- the CLI

EPILOG = """\
examples:
  dstr-plan --recipe recipes/16pcs/16pcs.json --world_size 16
  dstr-plan --recipe recipes/16pcs/16pcs.json --hostfile run_scripts/hostfiles/hostfile_2nodes
  dstr-plan --recipe recipes/8pcs/8pcs.json --world_size 8 --d_model 1024 --json
  dstr-plan --recipe recipes/cpu-tiny/cpu-tiny.json    (its world_size 2; vocab: its tokenizer's)
  dstr-plan --recipe recipes/8pcs/8pcs.json --world_size 8 --d_model 4096 --device a100-40gb
  dstr-plan --recipe recipes/8pcs/8pcs.json --world_size 8 --d_model 2048 --num_heads 16 \
      --ffn_size 8192 --encoder_layer 12 --decoder_layer 12 --src_len 512 --tgt_len 512 --batch_size 256
      (does not fit an h100: the verdict names --recompute 1 and --micro_batch_num 4)
  dstr-plan --recipe recipes/transformer-big-wmt14-en-fr/transformer-big-wmt14-en-fr-16gpu.json \
      --world_size 16 --batch_size 1536 --predict_speed      (step time and scaling: docs/speed.md)
  dstr-plan --recipe recipes/16pcs/16pcs.json --slurm --gpus_per_node 8
      (the sbatch line for run_scripts/slurm.sbatch, with the signal lead: docs/slurm.md)

Any train.py flag overrides the recipe, as in training. The memory section says, per pipeline stage, whether the
largest rank's peak (parameters, gradients, optimizer state, activations and DeepSpeed's buffers) fits 80% of the
device's memory (--device, default h100; or --device_memory GiB) and, when it does not, which changes would make it
fit. Pipeline stages more than 1.5x apart and micro-batches too small for the GPUs are flagged with re-planned
remedies (docs/parallelism.md). A layout that cannot run exits with status 2 and one `error:` line listing the
layouts that would fit.
"""


# train.py's flags a plan depends on, which --help shows after plan.py's own; --help_all adds the other ~60 (data,
# schedule, logging, validation, checkpoints, failures), which change nothing in a plan: --help was 380 lines
PLAN_FLAGS = {
    "recipe",
    "world_size",
    "model_parallel",
    "pipeline_stage",
    "micro_batch_num",
    "batch_size",
    "zero_stage",
    "optimizer_shard",
    "recompute",
    "vocab_emb_dp",
    "pipeline_func",
    "interleave_num",
    "precision",
    "max_tokens",
    "deepspeed_config",
    "vocab_size",
    "tokenizer",
    "tokenizer_vocab_size",
    "d_model",
    "num_heads",
    "ffn_size",
    "encoder_layer",
    "decoder_layer",
    "src_len",
    "tgt_len",
    "share_embeddings",
}
SHORT_USAGE = """dstr-plan --recipe R.json [--world_size N | --hostfile H] [--device NAME] [--json | --check]
                 [dstr-plan flags below] [any dstr-train flag: the ones a plan depends on below]
       dstr-plan --help_all     (every flag, dstr-train's data, schedule, logging and checkpoint ones included)"""


class _HelpAll(argparse.Action):
    """--help_all: the full help, every train.py flag included."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        build_plan_parser(full=True).print_help()
        parser.exit()


def _common_flags_first(p: argparse.ArgumentParser) -> None:
    """--help: plan.py's main flags first, then only the train.py flags in PLAN_FLAGS (argparse leaves out a group
    whose flags are all hidden), then the --slurm, --predict_speed and --search groups. Parsing is unchanged: a
    hidden flag is still taken."""
    main = [g for g in p._action_groups if g.title == "dstr-plan"]
    more = [g for g in p._action_groups if (g.title or "").startswith("dstr-plan ")]
    rest = [g for g in p._action_groups if g not in main + more]
    p._action_groups[:] = rest[:2] + main + rest[2:] + more  # argparse's own two groups (-h, --recipe) on top
    for group in rest[2:]:
        for action in group._group_actions:
            if action.dest not in PLAN_FLAGS:
                action.help = argparse.SUPPRESS
    p.usage = SHORT_USAGE


def build_plan_parser(full: bool = False) -> argparse.ArgumentParser:
    """plan.py's parser: train.py's flags and its own; `full`: --help lists every flag (what --help_all prints)."""
    p = build_parser()
    p.prog = "dstr-plan"
    p.description = (
        "Check a recipe against a world size or hostfile and show its layout, rank placement, stage "
        "contents, per-rank memory and communication — without starting training."
    )
    p.epilog = EPILOG
    p.add_argument("--help_all", action=_HelpAll, help="show every flag, train.py's included, and exit")
    g = p.add_argument_group("dstr-plan")
    g.add_argument("--hostfile", default=None, help="DeepSpeed hostfile: world = its slots, nodes = its hosts")
    g.add_argument(
        "--gpus_per_node", type=integer(1), default=8, help="ranks per node when no hostfile is given (default 8)"
    )
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    g.add_argument(
        "--check",
        action="store_true",
        help="only make the checks train.py makes before it starts (layout, pipeline_func, the recipe's "
        "DeepSpeed settings) and print one line (no vocab_size needed); the launch scripts run this "
        "before starting the ranks",
    )
    g.add_argument(
        "--device",
        default=None,
        metavar="NAME",
        help=f"the GPU the memory verdict is for: {', '.join(mem.DEVICE_MEMORY_GIB)} (default h100)",
    )
    g.add_argument(
        "--device_memory",
        type=number(0, low_open=True, why="GiB of one device"),
        default=None,
        metavar="GiB",
        help="the memory of one device in GiB, for a GPU not in --device's list",
    )
    g.add_argument(
        "--write_hostfile",
        default=None,
        metavar="PATH",
        help="with --hostfile: write it as the launcher should read it (byte-order mark, CRLF, tabs and "
        "comments dropped; run_cluster.sh passes this copy to DeepSpeed and mpirun)",
    )
    _add_slurm_flags(p)
    _add_speed_flags(p)
    from training.plan.search_cli import add_search_flags

    add_search_flags(p)  # its own group: plan.py --search (docs/layout-search.md)
    if not full:
        _common_flags_first(p)
    return p


def _add_slurm_flags(p: argparse.ArgumentParser) -> None:
    sl = p.add_argument_group("dstr-plan --slurm (docs/slurm.md)")
    sl.add_argument(
        "--slurm",
        action="store_true",
        help="print the sbatch line for this layout (run_scripts/slurm.sbatch): nodes, tasks and GPUs per "
        "node (--gpus_per_node), the signal lead sized from the predicted save and step times, and "
        "a note on the time limit (text and --json)",
    )
    sl.add_argument(
        "--save_GB_s",
        type=number(0, low_open=True, why="a bandwidth"),
        default=slurm_line.SAVE_GB_S,
        metavar="GB/s",
        help=f"GB/s a job writes its checkpoint to shared storage, for --slurm's signal "
        f"lead (default {slurm_line.SAVE_GB_S:g})",
    )


def _add_speed_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("dstr-plan --predict_speed (docs/speed.md)")
    s.add_argument(
        "--predict_speed",
        action="store_true",
        help="add a prediction of the step time and scaling efficiency (text and --json)",
    )
    s.add_argument(
        "--step_time_1gpu",
        type=number(0, low_open=True, why="seconds"),
        default=None,
        metavar="SECONDS",
        help="one GPU's measured step time on one data-parallel rank's batch (default: the model's FLOPs "
        "at --assumed_mfu of --device's peak — assumed, not measured)",
    )
    s.add_argument(
        "--assumed_mfu",
        type=number(0, 1, low_open=True, why="a share of the peak"),
        default=speed.ASSUMED_MFU,
        help=f"MFU of the default one-GPU step time (default {speed.ASSUMED_MFU})",
    )
    s.add_argument(
        "--intra_node_GB_s",
        type=number(0, low_open=True, why="a bandwidth"),
        default=speed.INTRA_NODE_GB_S,
        metavar="GB/s",
        help=f"GB/s a GPU sends to another of its node, each way (default {speed.INTRA_NODE_GB_S:g}: "
        f"H100 SXM NVLink 4)",
    )
    s.add_argument(
        "--inter_node_Gb_s",
        type=number(0, low_open=True, why="a bandwidth"),
        default=speed.INTER_NODE_GB_S,
        metavar="Gb/s",
        help=f"Gb/s a node sends to the network, all its NICs, each way (default {speed.INTER_NODE_GB_S:g}:"
        f" 8 × 400 Gb/s InfiniBand NDR, a DGX H100)",
    )


def main(argv: list | None = None) -> int:
    args = parse_args(argv, parser=build_plan_parser())
    cfg = TrainConfig.from_flags(args)
    world, hosts = resolve_world(
        args.world_size, args.hostfile, world_size_given="world_size" in given_flags(build_plan_parser(), argv)
    )
    if args.write_hostfile:
        if hosts is None:
            raise UserError("--write_hostfile needs --hostfile")
        from common.user_files import refuse_output_over_inputs

        refuse_output_over_inputs(
            args.write_hostfile, "--write_hostfile", [(f"--hostfile {args.hostfile}", args.hostfile)]
        )
        with open(args.write_hostfile, "w", encoding="utf-8") as f:
            f.write(format_hostfile(hosts))
    if args.check:
        print(check_line(cfg, world, hosts))
        return 0
    # token batches are planned at their token budget, not at --batch_size (training/plan/token_budget.py)
    cfg, budget = token_budget.planning_batch(cfg, "batch_size" in given_flags(build_plan_parser(), argv))
    from training.plan.search_cli import check_flags, run_search

    check_flags(args)  # --trials, --write_recipe, ... without --search: one line
    if args.search:  # choose the layout instead of checking one (docs/layout-search.md)
        return run_search(args, argv, cfg, world, hosts, budget)
    plan = make_plan(cfg, world, hosts, args.gpus_per_node, device=args.device, device_memory=args.device_memory)
    if budget:
        plan["token_budget"] = budget
    if args.predict_speed or args.slurm:
        per_node = max(h.slots for h in hosts) if hosts else args.gpus_per_node
        links = speed.Links(args.intra_node_GB_s, args.inter_node_Gb_s, per_node)
        plan["speed"] = speed.speed_section(
            plan, configs(cfg, world)[0], args.step_time_1gpu, args.device, links, args.assumed_mfu
        )
    if args.slurm:  # the sbatch line alone (with --json: the plan holds it as "slurm")
        per_node = max(h.slots for h in hosts) if hosts else args.gpus_per_node
        plan["slurm"] = slurm_line.slurm_section(plan, plan["speed"]["step_time_s"], per_node, args.save_GB_s)
        if not args.json:
            print("\n".join(slurm_line.format_slurm(plan["slurm"], plan["layout"])))
            return 0
    print(as_json(plan) if args.json else format_plan(plan))
    sys.stdout.flush()
    return 0
