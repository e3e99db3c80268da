"""Plan a run without starting it: layout, where every rank runs, what each stage holds, memory and communication.

`run_scripts/plan.py --recipe R.json (--world_size N | --hostfile H) [train.py flags]` calls `main` here. Nothing
below creates a process group, calls deepspeed.initialize or reads data: the layout goes through the same
`validate_layout` / `assign_stages` that training uses, and every distinct (stage, TP rank) builds its real blocks
(`model.transformer.block_specs` with `ParallelContext(tp_size, tp_rank)`, no group) on torch's `meta` device —
shapes without storage — so parameter counts are those of the run, for 16 or 64 ranks in a second or two.

What is counted (per rank; b = micro-batch size, s/t = source/target length, h = d_model, f = FFN size,
a = heads, tp = model_parallel, V' = vocab padded to a multiple of tp, n = the rank's parameter count):

memory     fp32: params 4n, grads 4n, AdamW exp_avg + exp_avg_sq 8n; fp16/bf16: 2n, 2n and 12n (fp32 master copy
           + 2 states). ZeRO >= 1 divides the optimizer state by dp, ZeRO >= 2 the grads, ZeRO 3 the params
           (⌈n/dp⌉; DeepSpeed's bucket alignment padding is ignored).
activations  tensors saved for backward per micro-batch, in elements of the training precision (4 bytes in fp32;
           dropout masks 1 byte each when dropout > 0):
           encoder layer  b·s·(4h + 4h/tp + 2f/tp) + k·b·(a/tp)·s²            (+ b·s·h for the final LayerNorm)
           decoder layer  b·t·(6h + 6h/tp + 2f/tp) + 2·b·s·h/tp + k·b·(a/tp)·(t² + t·s)
           per stage with decoder layers  + b·s·h (the encoder memory, input of every cross-attention K/V)
           head           2·b·t·h + 2·b·t·V'/tp (logits shard and the loss's exp)
           k = 2 with attention dropout (probabilities and their dropped copy), else 1. With recompute a block keeps
           only its input (b·s·h or b·t·h) plus the carried tensor once, and one block's full set is live while it
           is recomputed. Peak ≈ micro-batches in flight × per-micro-batch (+ that one block): in flight =
           min(pp - stage, micro_batch_num) under DeepSpeed's 1F1B schedule, 1 without pipelining.
tensor parallel  all-reduces of b·s·h (encoder) or b·t·h (decoder) elements: per encoder layer 2 forward + 2
           backward, per decoder layer 3 + 3; per stage holding decoder layers 1 backward (the memory's gradient);
           the head's input 1 backward; the loss 3 small forward ones (b·t, b·t, 2·b·t); split embeddings
           (vocab_emb_dp false) 2 forward (b·s·h, b·t·h); recompute repeats the blocks' forward ones in backward.
           These are exactly the calls `model.mappings.CommLog` records (tests/test_tp_model.py, tests/test_plan.py).
           A ring all-reduce of P bytes over tp ranks sends 2·(tp-1)/tp·P per rank.
pipeline   per micro-batch across each stage boundary: after an encoder block or a non-last decoder block the tuple
           (two floats [b,s,h] and [b,t,h], src_ids [b,s] and tgt_ids [b,t] int64), backward the two float
           gradients; after the last decoder block only [b,t,h] and its gradient. Every TP rank sends its own copy.
data parallel  ring volume sent per rank, G = grad bytes, P = param bytes of the rank, r = (dp-1)/dp:
           ZeRO 0 all-reduce 2r·G per step; ZeRO 1 reduce-scatter r·G + all-gather r·P per step; ZeRO 2 reduce-scatter
           r·G every micro-batch + all-gather r·P per step; ZeRO 3 per micro-batch all-gather 2r·P (forward and
           backward) + reduce-scatter r·G.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence

from model.config import ModelConfig, ParallelConfig, validate_layout
from model.pipeline import assign_stages, layer_stages, load_pipeline_func, pipeline_func_name, place_blocks
from preprocess.errors import UserError
from training.args import build_parser, model_config, parallel_config, parse_args
from training.cluster import Host, rank_nodes, read_hostfile

INT64 = 8


# ---------------------------------------------------------------------------------------------------------- layout

def layer_names(model: ModelConfig) -> list[str]:
    """Names of the pipeline layers in order: embeddings, encoder.i, decoder.i, head."""
    return (["embeddings"] + [f"encoder.{i}" for i in range(model.encoder_layers)]
            + [f"decoder.{i}" for i in range(model.decoder_layers)] + ["head"])


def stage_layers(model: ModelConfig, parallel: ParallelConfig, pipeline_func=None) -> list[list[int]]:
    """Indices (into layer_names) of the layers each stage holds, from the recipe's pipeline_func."""
    stages = layer_stages(model, parallel, assign_stages(model, parallel, pipeline_func))
    return [[i for i, s in enumerate(stages) if s == k] for k in range(parallel.pipeline_stage)]


def build_stage_modules(model: ModelConfig, parallel: ParallelConfig, stage: int, tp_rank: int,
                        pipeline_func=None, seed: int = 0, device: str = "meta") -> list[tuple[str, object]]:
    """The modules one rank of (stage, tp_rank) builds, with a ParallelContext and no process group.

    `device="meta"` gives real shapes without allocating or initialising weights."""
    import torch

    from model.topology import ParallelContext
    from model.transformer import block_specs
    placements = place_blocks(model, parallel, pipeline_func)
    stages = layer_stages(model, parallel, [p.pipeline_stage for p in placements])
    ctx = ParallelContext(tp_size=parallel.model_parallel, tp_rank=tp_rank, tp_group=None,
                          pp_size=parallel.pipeline_stage, pp_rank=stage)
    specs = block_specs(model, parallel, ctx, seed, placements)
    names = layer_names(model)
    out = []
    with torch.device(device):
        for i, (cls, kw) in enumerate(specs):
            if stages[i] == stage:
                out.append((names[i], cls(**kw)))
    return out


def count_params(modules: Sequence[tuple[str, object]]) -> dict[str, int]:
    return {name: sum(p.numel() for p in m.parameters()) for name, m in modules}


# ---------------------------------------------------------------------------------------------------------- memory

def state_bytes(n_params: int, dp: int, zero: int, precision: str = "fp32") -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and AdamW state for n_params parameters (see module docstring)."""
    half = precision in ("fp16", "bf16")
    p_b, g_b, o_b = (2, 2, 12) if half else (4, 4, 8)
    part = -(-n_params // dp)           # ZeRO partition: ⌈n/dp⌉ elements

    def n(stage_needed: int) -> int:
        return part if zero >= stage_needed else n_params

    out = {"param_bytes": n(3) * p_b, "grad_bytes": n(2) * g_b, "optimizer_bytes": n(1) * o_b}
    out["total_bytes"] = sum(out.values())
    return out


def _encoder_elems(m: ModelConfig, tp: int, b: int, last: bool) -> tuple[int, int]:
    """(float elements, mask bytes) saved by one encoder layer for one micro-batch."""
    s, h, f, a = m.src_len, m.d_model, m.ffn, m.num_heads // tp
    k = 2 if m.attention_dropout > 0 else 1
    elems = b * s * (4 * h + 4 * h // tp + 2 * f // tp) + k * b * a * s * s + (b * s * h if last else 0)
    masks = (2 * b * s * h if m.dropout > 0 else 0) + (b * a * s * s if m.attention_dropout > 0 else 0)
    return elems, masks


def _decoder_elems(m: ModelConfig, tp: int, b: int) -> tuple[int, int]:
    s, t, h, f, a = m.src_len, m.tgt_len, m.d_model, m.ffn, m.num_heads // tp
    k = 2 if m.attention_dropout > 0 else 1
    elems = b * t * (6 * h + 6 * h // tp + 2 * f // tp) + 2 * b * s * h // tp + k * b * a * (t * t + t * s)
    masks = (3 * b * t * h if m.dropout > 0 else 0) + (b * a * (t * t + t * s) if m.attention_dropout > 0 else 0)
    return elems, masks


def activation_bytes(m: ModelConfig, p: ParallelConfig, names: Sequence[str], micro: int,
                     precision: str = "fp32", recomputed: Optional[Sequence[str]] = None) -> dict[str, int]:
    """Activation estimate of one stage holding the layers `names` (formula in the module docstring);
    `recomputed`: the blocks pipeline_func recomputes (default: every block when p.recompute)."""
    tp, b, s, t, h = p.model_parallel, micro, m.src_len, m.tgt_len, m.d_model
    el = 2 if precision in ("fp16", "bf16") else 4
    recomputed = _recomputed(p, names, recomputed)
    kept = other = carried = 0
    largest = 0
    for name in names:
        if name == "embeddings":
            other += b * (s + t) * h if m.dropout > 0 else 0                  # dropout masks
        elif name.startswith(("encoder.", "decoder.")):
            if name.startswith("encoder."):
                e, k = _encoder_elems(m, tp, b, last=name == f"encoder.{m.encoder_layers - 1}")
                block_input = b * s * h * el
                carried = max(carried, b * t * h * el) if name in recomputed else carried    # tgt_h rides along
            else:
                e, k = _decoder_elems(m, tp, b)
                block_input = b * t * h * el
                carried = b * s * h * el if name in recomputed else carried                  # the encoder memory
            if name in recomputed:
                kept, largest = kept + block_input, max(largest, e * el + k)
            else:
                kept += e * el + k
        elif name == "head":
            other += (2 * b * t * h + 2 * b * t * m.padded_vocab(tp) // tp) * el
    decoders = [n for n in names if n.startswith("decoder.")]
    # the memory, input of every cross-attention K/V: counted once per stage unless only carried (all recomputed)
    memory = b * s * h * el if decoders and not all(n in recomputed for n in decoders) else 0
    if memory:
        carried = 0
    return {"per_micro_batch": other + kept + carried + memory, "recompute_transient": largest}


def _recomputed(p: ParallelConfig, names: Sequence[str], recomputed: Optional[Sequence[str]]) -> set[str]:
    """The blocks among `names` whose forward is recomputed in backward."""
    blocks = {n for n in names if n.startswith(("encoder.", "decoder."))}
    if recomputed is None:
        return blocks if p.recompute else set()
    return blocks & set(recomputed)


def in_flight(p: ParallelConfig, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once (DeepSpeed 1F1B; gradient accumulation: 1)."""
    if p.pipeline_stage == 1:
        return 1
    return min(p.pipeline_stage - stage, p.micro_batch_num)


# ---------------------------------------------------------------------------------------------------- communication

def tp_allreduces(m: ModelConfig, p: ParallelConfig, names: Sequence[str], micro: int,
                  recomputed: Optional[Sequence[str]] = None) -> dict[str, list[int]]:
    """Element counts of every TP all-reduce one rank of this stage issues per micro-batch: "forward" and
    "backward" (activations and their gradients, `CommLog` op "all_reduce") and "loss" (the vocab-parallel loss's
    statistics, fp32, op "loss_all_reduce"). `recomputed` as in activation_bytes."""
    fwd: list[int] = []
    bwd: list[int] = []
    loss: list[int] = []
    if p.model_parallel > 1:
        b, s, t, h = micro, m.src_len, m.tgt_len, m.d_model
        n_enc = sum(1 for n in names if n.startswith("encoder."))
        n_dec = sum(1 for n in names if n.startswith("decoder."))
        fwd += [b * s * h] * (2 * n_enc) + [b * t * h] * (3 * n_dec)
        bwd += [b * s * h] * (2 * n_enc) + [b * t * h] * (3 * n_dec)
        if "embeddings" in names and not p.vocab_emb_dp:
            fwd += [b * s * h, b * t * h]               # split word tables: partial lookups summed
        if n_dec:
            bwd.append(b * s * h)                       # the memory's gradient, once per stage
        if "head" in names:
            bwd.append(b * t * h)                       # the head's input gradient
            loss += [b * t, b * t, 2 * b * t]           # max, sum-exp, (target logit, logit sum)
        rc = _recomputed(p, names, recomputed)          # the recomputed blocks' forward, again inside backward
        bwd += [b * s * h] * (2 * sum(1 for n in rc if n.startswith("encoder.")))
        bwd += [b * t * h] * (3 * sum(1 for n in rc if n.startswith("decoder.")))
    return {"forward": fwd, "backward": bwd, "loss": loss}


def boundary_tensors(m: ModelConfig, last_layer: str, micro: int) -> list[dict]:
    """What crosses a stage boundary after `last_layer`, per micro-batch."""
    b, s, t, h = micro, m.src_len, m.tgt_len, m.d_model
    if last_layer == f"decoder.{m.decoder_layers - 1}":
        return [{"name": "tgt_h", "shape": [b, t, h], "float": True}]
    if last_layer.startswith("decoder.") or last_layer == f"encoder.{m.encoder_layers - 1}":
        first = [{"name": "tgt_h", "shape": [b, t, h], "float": True},
                 {"name": "memory", "shape": [b, s, h], "float": True}]
    else:                                           # embeddings or a non-last encoder block
        first = [{"name": "src_h", "shape": [b, s, h], "float": True},
                 {"name": "tgt_h", "shape": [b, t, h], "float": True}]
    return first + [{"name": "src_ids", "shape": [b, s], "float": False},
                    {"name": "tgt_ids", "shape": [b, t], "float": False}]


def dp_bytes(grad_bytes_full: int, param_bytes_full: int, p: ParallelConfig) -> dict:
    """Bytes one rank sends per step for data-parallel gradient sync (ring volumes; see module docstring)."""
    dp, zero, mb = p.data_parallel, p.effective_zero_stage, p.micro_batch_num
    if dp == 1:
        return {"bytes_per_step": 0, "how": "dp = 1: no data-parallel communication"}
    r = (dp - 1) / dp
    G, P = grad_bytes_full, param_bytes_full
    if zero == 0:
        total, how = 2 * r * G, "all-reduce of the gradients once per step: 2·(dp-1)/dp × grads"
    elif zero == 1:
        total, how = r * G + r * P, ("reduce-scatter of the gradients + all-gather of the updated parameters once "
                                     "per step: (dp-1)/dp × (grads + params)")
    elif zero == 2:
        total, how = mb * r * G + r * P, ("reduce-scatter of the gradients every micro-batch + all-gather of the "
                                          "parameters per step")
    else:
        total, how = mb * (2 * r * P + r * G), ("per micro-batch: all-gather of the parameters in forward and "
                                               "backward + reduce-scatter of the gradients")
    return {"bytes_per_step": int(round(total)), "how": how}


# ------------------------------------------------------------------------------------------------------------ plan

def resolve_world(world_size: Optional[int], hostfile: Optional[str]) -> tuple[int, Optional[list[Host]]]:
    hosts = read_hostfile(hostfile) if hostfile else None
    if hosts is not None:
        slots = sum(h.slots for h in hosts)
        if world_size is not None and world_size != slots:
            raise UserError(f"--world_size {world_size} but the hostfile {hostfile} has {slots} slots; give one")
        return slots, hosts
    if world_size is None:
        raise UserError("give the world to plan for: --world_size N (processes) or --hostfile H (DeepSpeed hostfile)")
    if world_size < 1:
        raise UserError(f"--world_size {world_size} must be >= 1")
    return world_size, None


def configs(args, world_size: int, need_vocab: bool = True) -> tuple[ModelConfig, ParallelConfig]:
    """The ModelConfig / ParallelConfig train.py would build, validated by validate_layout (as train.py does)."""
    parallel = parallel_config(args, world_size)
    if args.vocab_size is None and need_vocab:
        raise UserError("vocab_size is needed to size the embeddings and the head: set \"vocab_size\" in the "
                        "recipe's \"model\" section or pass --vocab_size N (train.py otherwise uses the tokenizer's "
                        f"size: --tokenizer_vocab_size, {args.tokenizer_vocab_size} for the auto-built BPE one)")
    model = model_config(args, vocab_size=args.vocab_size or 1, pad_id=0)
    validate_layout(parallel, model, world_size=world_size, global_batch=args.batch_size)
    return model, parallel


def make_plan(args, world_size: int, hosts: Optional[list[Host]] = None, ranks_per_node: int = 8) -> dict:
    """Everything plan.py prints, as a JSON-serialisable dict."""
    from model.topology import rank_map            # imports DeepSpeed: kept out of the fast --check path
    model, parallel = configs(args, world_size)
    func = load_pipeline_func(args.pipeline_func)
    names = layer_names(model)
    per_stage = stage_layers(model, parallel, func)
    placements = place_blocks(model, parallel, func)
    recomputed = [p.name for p in placements if p.recomputed]
    micro = args.batch_size // (parallel.data_parallel * parallel.micro_batch_num)
    zero, prec = parallel.effective_zero_stage, args.precision
    tp, dp, pp = parallel.model_parallel, parallel.data_parallel, parallel.pipeline_stage
    el = 2 if prec in ("fp16", "bf16") else 4

    # every distinct (stage, tp rank) builds its own blocks and counts their parameters
    counts: dict[tuple[int, int], dict[str, int]] = {}
    for k in range(pp):
        for r in range(tp):
            counts[(k, r)] = count_params(build_stage_modules(model, parallel, k, r, func, seed=args.seed))

    from training.engine import deepspeed_config   # the DeepSpeed config train.py would use: checks the overrides
    ds_cfg = deepspeed_config(parallel, args.batch_size, prec, args.clip_grad,
                              sum(counts[(0, 0)].values()),          # rank 0's gradient elements, as train.py
                              getattr(args, "deepspeed_overrides", None), args.deepspeed_config)

    nodes = rank_nodes(world_size, hosts, ranks_per_node)
    ranks = []
    for c in rank_map(parallel):
        n = sum(counts[(c.pp, c.tp)].values())
        node, host, local = nodes[c.rank]
        ranks.append({"rank": c.rank, "node": node, "host": host, "local_rank": local, "pp": c.pp, "dp": c.dp,
                      "tp": c.tp, "params": n, **state_bytes(n, dp, zero, prec)})

    def group_spans_nodes(key) -> int:
        groups: dict = {}
        for r in ranks:
            groups.setdefault(key(r), set()).add(r["node"])
        return sum(1 for v in groups.values() if len(v) > 1)

    stages = []
    for k, idx in enumerate(per_stage):
        layer_list = [names[i] for i in idx]
        stage_ranks = [r["rank"] for r in ranks if r["pp"] == k]
        ar = tp_allreduces(model, parallel, layer_list, micro, recomputed)
        bytes_per_micro = (sum(ar["forward"]) + sum(ar["backward"])) * el + sum(ar["loss"]) * 4
        acts = activation_bytes(model, parallel, layer_list, micro, prec, recomputed)
        fl = in_flight(parallel, k)
        n0 = sum(counts[(k, 0)].values())
        stage = {
            "stage": k, "layers": layer_list, "ranks": [min(stage_ranks), max(stage_ranks)],
            "params_per_rank": n0, "params_by_layer": counts[(k, 0)],
            "activations": {**acts, "in_flight": fl, "peak": acts["per_micro_batch"] * fl
                            + acts["recompute_transient"]},
            "tp_allreduce": {"forward_elements": ar["forward"], "backward_elements": ar["backward"],
                             "loss_elements": ar["loss"],
                             "calls_per_micro_batch": sum(len(v) for v in ar.values()),
                             "bytes_per_micro_batch": bytes_per_micro,
                             "bytes_per_step": bytes_per_micro * parallel.micro_batch_num,
                             "sent_per_rank_per_step": int(round(2 * (tp - 1) / tp * bytes_per_micro
                                                                 * parallel.micro_batch_num))},
            "dp": dp_bytes(n0 * el, n0 * el, parallel),
        }
        if k < pp - 1:
            tensors = boundary_tensors(model, layer_list[-1], micro)
            for tsr in tensors:
                tsr["bytes"] = math.prod(tsr["shape"]) * (el if tsr["float"] else INT64)
            fwd = sum(tsr["bytes"] for tsr in tensors)
            bwd = sum(tsr["bytes"] for tsr in tensors if tsr["float"])
            stage["send_next"] = {"tensors": tensors, "forward_bytes_per_micro_batch": fwd,
                                  "backward_bytes_per_micro_batch": bwd,
                                  "bytes_per_step": (fwd + bwd) * parallel.micro_batch_num}
        stages.append(stage)

    return {
        "recipe": args.recipe, "world_size": world_size,
        "nodes": ([{"host": h.name, "slots": h.slots} for h in hosts] if hosts is not None
                  else {"ranks_per_node": ranks_per_node, "count": -(-world_size // ranks_per_node)}),
        "layout": {"data_parallel": dp, "model_parallel": tp, "pipeline_stage": pp,
                   "micro_batch_num": parallel.micro_batch_num, "zero_stage": zero,
                   "optimizer_shard": parallel.optimizer_shard, "recompute": parallel.recompute,
                   "vocab_emb_dp": parallel.vocab_emb_dp, "pipeline_func": pipeline_func_name(func),
                   "global_batch": args.batch_size, "micro_batch": micro,
                   "tp_groups_spanning_nodes": group_spans_nodes(lambda r: (r["pp"], r["dp"])),
                   "dp_groups_spanning_nodes": group_spans_nodes(lambda r: (r["pp"], r["tp"]))},
        "model": {"vocab_size": model.vocab_size, "padded_vocab": model.padded_vocab(tp), "d_model": model.d_model,
                  "num_heads": model.num_heads, "ffn_size": model.ffn, "encoder_layers": model.encoder_layers,
                  "decoder_layers": model.decoder_layers, "src_len": model.src_len, "tgt_len": model.tgt_len,
                  "precision": prec},
        "deepspeed": {"train_batch_size": ds_cfg["train_batch_size"],
                      "train_micro_batch_size_per_gpu": ds_cfg["train_micro_batch_size_per_gpu"],
                      "gradient_accumulation_steps": ds_cfg["gradient_accumulation_steps"],
                      "zero_optimization": ds_cfg["zero_optimization"]},
        "blocks": [{"block": p.name, "stage": p.pipeline_stage, "recompute": p.recomputed,
                    "comm_fusion": p.comm_fusion} for p in placements],
        "stages": stages, "ranks": ranks,
    }


# ---------------------------------------------------------------------------------------------------------- output

def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def check_line(args, world_size: int, hosts=None) -> str:
    model, parallel = configs(args, world_size, need_vocab=False)
    func = load_pipeline_func(args.pipeline_func)
    per = stage_layers(model, parallel, func)
    names = layer_names(model)
    micro = args.batch_size // (parallel.data_parallel * parallel.micro_batch_num)
    stages = " | ".join(f"stage {k}: {compact_layers([names[i] for i in idx])}" for k, idx in enumerate(per))
    stages = f"pipeline_func {pipeline_func_name(func)}: {stages}"
    return (f"layout ok: {world_size} ranks = dp {parallel.data_parallel} × mp {parallel.model_parallel} × pp "
            f"{parallel.pipeline_stage}; global batch {args.batch_size} = micro {micro} × micro_batch_num "
            f"{parallel.micro_batch_num} × dp {parallel.data_parallel}; ZeRO {parallel.effective_zero_stage}; "
            f"{stages}")


def compact_layers(layers: Sequence[str]) -> str:
    """['embeddings', 'encoder.0', 'encoder.1', 'encoder.2'] → 'embeddings, encoder.0-2'."""
    out: list[str] = []
    run: list[str] = []

    def flush():
        if run:
            kind = run[0].split(".")[0]
            out.append(run[0] if len(run) == 1 else f"{kind}.{run[0].split('.')[1]}-{run[-1].split('.')[1]}")
            run.clear()

    for name in layers:
        if "." in name and run and name.split(".")[0] == run[-1].split(".")[0]:
            run.append(name)
            continue
        flush()
        if "." in name:
            run.append(name)
        else:
            out.append(name)
    flush()
    return ", ".join(out)


SPLITS = {"seed": "default: block i on stage min(i // max(blocks // pp, 1), pp - 1)",
          "even": "block i on stage i · pp // blocks"}


def format_plan(plan: dict) -> str:
    L, M, S = plan["layout"], plan["model"], plan["stages"]
    out = []
    world = plan["world_size"]
    if isinstance(plan["nodes"], list):
        where = (f"{len(plan['nodes'])} node(s) from the hostfile: "
                 + ", ".join(f"{n['host']} ×{n['slots']}" for n in plan["nodes"]))
    else:
        where = (f"{plan['nodes']['count']} node(s) of {plan['nodes']['ranks_per_node']} ranks "
                 f"(--gpus_per_node)")
    out.append(f"plan: {plan['recipe'] or '(flags only)'} on {world} ranks, {where}")
    zero_why = {0: "off", 1: "optimizer state sharded over dp", 2: "optimizer state + gradients sharded over dp",
                3: "optimizer state + gradients + parameters sharded over dp"}[L["zero_stage"]]
    out.append(f"  layout     dp {L['data_parallel']} × mp {L['model_parallel']} × pp {L['pipeline_stage']} = "
               f"{world}; ZeRO {L['zero_stage']} ({zero_why}); recompute {'on' if L['recompute'] else 'off'}; "
               f"embeddings {'replicated (vocab_emb_dp)' if L['vocab_emb_dp'] else 'split over mp'}")
    out.append(f"  batch      global {L['global_batch']} = micro {L['micro_batch']} × micro_batch_num "
               f"{L['micro_batch_num']} × dp {L['data_parallel']}")
    out.append(f"  model      vocab {M['vocab_size']} (head rows {M['padded_vocab']} = {L['model_parallel']} × "
               f"{M['padded_vocab'] // L['model_parallel']}), d_model {M['d_model']}, {M['num_heads']} heads "
               f"({M['num_heads'] // L['model_parallel']} per TP rank), ffn {M['ffn_size']}, "
               f"{M['encoder_layers']} encoder + {M['decoder_layers']} decoder layer(s), src_len {M['src_len']}, "
               f"tgt_len {M['tgt_len']}, {M['precision']}")
    notes = []
    if L["tp_groups_spanning_nodes"]:
        notes.append(f"{L['tp_groups_spanning_nodes']} TP group(s) span nodes: their all-reduces cross the network "
                     f"(keep model_parallel <= GPUs per node)")
    else:
        notes.append("every TP group sits inside one node")
    if L["data_parallel"] > 1:
        notes.append(f"{L['dp_groups_spanning_nodes']} DP group(s) span nodes (gradient sync crosses the network)"
                     if L["dp_groups_spanning_nodes"] else "every DP group sits inside one node")
    elif L["zero_stage"] > 0:
        notes.append(f"ZeRO {L['zero_stage']} with dp = 1 shards nothing (it pays off from dp = 2)")
    out.append(f"  placement  {'; '.join(notes)}")
    out.append(f"  pipeline   pipeline_func: {L['pipeline_func']}"
               + (f" ({SPLITS[L['pipeline_func']]})" if L["pipeline_func"] in SPLITS else ""))
    for st in S:
        out.append(f"    stage {st['stage']}: {compact_layers(st['layers']):<36} ranks {st['ranks'][0]}-{st['ranks'][1]}")
    out.append(f"    {'block':<12} {'stage':>5}  {'recompute':<9}  comm_fusion (reported, not used: model/pipeline.py)")
    for b in plan["blocks"]:
        out.append(f"    {b['block']:<12} {b['stage']:>5}  {'yes' if b['recompute'] else 'no':<9}  {b['comm_fusion']}")
    out.append("")
    out.append("ranks (rank = pp·dp·mp + dp·mp + tp: TP fastest, then DP, then PP); bytes per rank")
    hdr = (f"{'rank':>5} {'node':>4} {'host':<14} {'local':>5} {'pp':>3} {'dp':>3} {'tp':>3} {'params':>12} "
           f"{'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10}")
    out.append(hdr)
    for r in plan["ranks"]:
        out.append(f"{r['rank']:>5} {r['node']:>4} {r['host'][:14]:<14} {r['local_rank']:>5} {r['pp']:>3} "
                   f"{r['dp']:>3} {r['tp']:>3} {r['params']:>12,} {human(r['param_bytes']):>10} "
                   f"{human(r['grad_bytes']):>10} {human(r['optimizer_bytes']):>10} {human(r['total_bytes']):>10}")
    half = M["precision"] != "fp32"
    out.append(f"  {'fp16/bf16 params 2 B + grads 2 B + fp32 master and AdamW states 12 B' if half else 'fp32 params 4 B + grads 4 B + AdamW exp_avg/exp_avg_sq 8 B'}"
               f" per parameter; ZeRO {L['zero_stage']} divides "
               + {0: "nothing", 1: "the optimizer state", 2: "optimizer state and grads",
                  3: "optimizer state, grads and params"}[L["zero_stage"]] + f" by dp = {L['data_parallel']}")
    out.append("")
    out.append("activations per rank (estimate, formula in training/plan.py)")
    out.append(f"{'stage':>5}  {'params/rank':>12}  {'per micro-batch':>15}  {'in flight':>9}  {'peak':>10}")
    for st in S:
        a = st["activations"]
        out.append(f"{st['stage']:>5}  {st['params_per_rank']:>12,}  {human(a['per_micro_batch']):>15}  "
                   f"{a['in_flight']:>9}  {human(a['peak']):>10}")
    out.append("")
    mb = L["micro_batch_num"]
    out.append(f"communication per optimizer step ({mb} micro-batch{'es' if mb > 1 else ''} of {L['micro_batch']}), "
               f"per rank")
    tpn = L["model_parallel"]
    if tpn == 1:
        out.append("  tensor parallel: mp = 1, none")
    for st in S if tpn > 1 else []:
        t = st["tp_allreduce"]
        loss = f" + {len(t['loss_elements'])} loss" if t["loss_elements"] else ""
        out.append(f"  tensor parallel, stage {st['stage']}: {len(t['forward_elements'])} forward + "
                   f"{len(t['backward_elements'])} backward{loss} all-reduces per micro-batch = "
                   f"{human(t['bytes_per_micro_batch'])}; per step {human(t['bytes_per_step'])} payload, "
                   f"ring sends {human(t['sent_per_rank_per_step'])} (2·(mp-1)/mp × payload)")
    for st in S:
        if "send_next" not in st:
            continue
        nx = st["send_next"]
        desc = ", ".join(f"{t['name']} [{','.join(map(str, t['shape']))}]" for t in nx["tensors"])
        out.append(f"  pipeline, stage {st['stage']} → {st['stage'] + 1}: forward {desc} = "
                   f"{human(nx['forward_bytes_per_micro_batch'])}, backward gradients "
                   f"{human(nx['backward_bytes_per_micro_batch'])} per micro-batch; per step "
                   f"{human(nx['bytes_per_step'])} (each TP rank sends its own copy)")
    if L["pipeline_stage"] == 1:
        out.append("  pipeline: pp = 1, none")
    for st in S:
        d = st["dp"]
        if L["data_parallel"] == 1:
            out.append(f"  data parallel: {d['how']}")
            break
        out.append(f"  data parallel, stage {st['stage']}: {human(d['bytes_per_step'])} sent per rank per step "
                   f"({d['how']})")
    ds = plan["deepspeed"]
    out.append("")
    out.append(f"DeepSpeed config (rank 0): train_batch_size {ds['train_batch_size']}, train_micro_batch_size_per_gpu "
               f"{ds['train_micro_batch_size_per_gpu']}, gradient_accumulation_steps "
               f"{ds['gradient_accumulation_steps']}, zero_optimization {json.dumps(ds['zero_optimization'])}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------- the CLI

EPILOG = """\
examples:
  python run_scripts/plan.py --recipe recipes/16pcs/16pcs.json --world_size 16
  python run_scripts/plan.py --recipe recipes/16pcs/16pcs.json --hostfile run_scripts/hostfiles/hostfile_2nodes
  python run_scripts/plan.py --recipe recipes/8pcs/8pcs.json --world_size 8 --d_model 1024 --json
  python run_scripts/plan.py --recipe recipes/cpu-tiny/cpu-tiny.json --world_size 2 --vocab_size 2000

Any train.py flag overrides the recipe, as in training. A layout that cannot run exits with status 2 and one
`error:` line listing the layouts that would fit.
"""


def build_plan_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "plan.py"
    p.description = ("Check a recipe against a world size or hostfile and show its layout, rank placement, stage "
                     "contents, per-rank memory and communication — without starting training.")
    p.epilog = EPILOG
    g = p.add_argument_group("plan.py")
    g.add_argument("--world_size", type=int, default=None, help="processes to plan for")
    g.add_argument("--hostfile", default=None, help="DeepSpeed hostfile: world = its slots, nodes = its hosts")
    g.add_argument("--gpus_per_node", type=int, default=8,
                   help="ranks per node when no hostfile is given (default 8)")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    g.add_argument("--check", action="store_true",
                   help="only validate the layout and print one line (no vocab_size needed); the launch scripts "
                        "run this before starting the ranks")
    return p


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv, parser=build_plan_parser())
    world, hosts = resolve_world(args.world_size, args.hostfile)
    if args.check:
        print(check_line(args, world, hosts))
        return 0
    plan = make_plan(args, world, hosts, args.gpus_per_node)
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    sys.stdout.flush()
    return 0
