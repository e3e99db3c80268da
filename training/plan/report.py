"""plan.py's text report: the dict `training.plan.planner.make_plan` builds, as a person reads it."""

from __future__ import annotations

import json
from collections.abc import Sequence

from common.units import human_bytes as human
from training.plan import token_budget
from training.plan.speed_prediction import format_speed

RANK_ROWS = 256  # rank rows the text report prints before it shows only the ends


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


SPLITS = {
    "seed": "default: block i on stage min(i // max(blocks // pp, 1), pp - 1)",
    "even": "block i on stage i · pp // blocks",
}


def format_plan(plan: dict) -> str:
    """plan.py's report: layout, advice, per-rank bytes, the memory verdict, activations, communication, the
    DeepSpeed config and (with --predict_speed) the predicted step time."""
    out = _layout_lines(plan) + format_advice(plan) + [""] + _rank_lines(plan) + [""] + format_memory(plan) + [""]
    out += _activation_lines(plan) + [""] + _communication_lines(plan)
    ds = plan["deepspeed"]
    out.append("")
    out.append(
        f"DeepSpeed config (rank 0): train_batch_size {ds['train_batch_size']}, train_micro_batch_size_per_gpu "
        f"{ds['train_micro_batch_size_per_gpu']}, gradient_accumulation_steps "
        f"{ds['gradient_accumulation_steps']}, zero_optimization {json.dumps(ds['zero_optimization'])}"
    )
    if plan.get("speed"):
        out.append("")
        out.extend(format_speed(plan["speed"], plan["world_size"]))
    return "\n".join(out)


def _layout_lines(plan: dict) -> list[str]:
    """Where the ranks are, the layout and batch arithmetic, the model, placement and the pipeline's blocks."""
    L, M, S = plan["layout"], plan["model"], plan["stages"]
    out = []
    world = plan["world_size"]
    if isinstance(plan["nodes"], list):
        where = f"{len(plan['nodes'])} node(s) from the hostfile: " + ", ".join(
            f"{n['host']} ×{n['slots']}" for n in plan["nodes"]
        )
    else:
        where = f"{plan['nodes']['count']} node(s) of {plan['nodes']['ranks_per_node']} ranks (--gpus_per_node)"
    out.append(f"plan: {plan['recipe'] or '(flags only)'} on {world} ranks, {where}")
    zero_why = {
        0: "off",
        1: "optimizer state sharded over dp",
        2: "optimizer state + gradients sharded over dp",
        3: "optimizer state + gradients + parameters sharded over dp",
    }[L["zero_stage"]]
    if L.get("zero_stage_requested", L["zero_stage"]) != L["zero_stage"]:
        zero_why += (
            f"; ZeRO {L['zero_stage_requested']} asked, DeepSpeed runs {L['zero_stage']} in "
            f"{M['precision']} for its fp32 master weights"
        )
    out.append(
        f"  layout     dp {L['data_parallel']} × mp {L['model_parallel']} × pp {L['pipeline_stage']} = "
        f"{world}; ZeRO {L['zero_stage']} ({zero_why}); recompute {'on' if L['recompute'] else 'off'}; "
        f"embeddings {'replicated (vocab_emb_dp)' if L['vocab_emb_dp'] else 'split over mp'}"
    )
    out.append(
        f"  batch      global {L['global_batch']} = micro {L['micro_batch']} per GPU × micro_batch_num "
        f"{L['micro_batch_num']} × dp {L['data_parallel']}"
    )
    budget = plan.get("token_budget")
    if budget:  # token batches: the batch planned and where it comes from
        out.append(f"             {token_budget.describe(budget)}")
    if L["data_parallel"] > 1:
        keep = L["global_batch"] * L["data_parallel"]
        more = f"--max_tokens {token_budget.tokens_for(keep, budget):,}" if budget else f"--batch_size {keep}"
        out.append(
            f"             the global batch stays {L['global_batch']} at any world size, so each GPU's "
            f"micro-batch shrinks as dp grows: {L['micro_batch_at_dp1']} at dp 1 ({L['world_at_dp1']} ranks), "
            f"{L['micro_batch']} here; {more} keeps {L['micro_batch_at_dp1']} per GPU"
        )
    source = f"; {M['vocab_source']}" if M.get("vocab_source") else ""  # planner.planned_vocab
    out.append(
        f"  model      vocab {M['vocab_size']} (head rows {M['padded_vocab']} = {L['model_parallel']} × "
        f"{M['padded_vocab'] // L['model_parallel']}{source}), d_model {M['d_model']}, {M['num_heads']} heads "
        f"({M['num_heads'] // L['model_parallel']} per TP rank), ffn {M['ffn_size']}, "
        f"{M['encoder_layers']} encoder + {M['decoder_layers']} decoder layer(s), src_len {M['src_len']}, "
        f"tgt_len {M['tgt_len']}, {M['precision']}"
    )
    notes = []
    if L["tp_groups_spanning_nodes"]:
        notes.append(
            f"{L['tp_groups_spanning_nodes']} TP group(s) span nodes: their all-reduces cross the network "
            f"(keep model_parallel <= GPUs per node)"
        )
    else:
        notes.append("every TP group sits inside one node")
    if L["data_parallel"] > 1:
        notes.append(
            f"{L['dp_groups_spanning_nodes']} DP group(s) span nodes (gradient sync crosses the network)"
            if L["dp_groups_spanning_nodes"]
            else "every DP group sits inside one node"
        )
    elif L["zero_stage"] > 0:
        notes.append(f"ZeRO {L['zero_stage']} with dp = 1 shards nothing (it pays off from dp = 2)")
    out.append(f"  placement  {'; '.join(notes)}")
    out.append(
        f"  pipeline   pipeline_func: {L['pipeline_func']}"
        + (f" ({SPLITS[L['pipeline_func']]})" if L["pipeline_func"] in SPLITS else "")
    )
    for st in S:
        out.append(
            f"    stage {st['stage']}: {compact_layers(st['layers']):<36} ranks {st['ranks'][0]}-{st['ranks'][1]}"
        )
    out.append(f"    {'block':<12} {'stage':>5}  {'recompute':<9}  comm_fusion (reported, not used: model/pipeline.py)")
    for b in plan["blocks"]:
        out.append(f"    {b['block']:<12} {b['stage']:>5}  {'yes' if b['recompute'] else 'no':<9}  {b['comm_fusion']}")
    return out


def _rank_lines(plan: dict) -> list[str]:
    """A row of bytes per rank (the ends of a very large world), and what a parameter costs."""
    L, M = plan["layout"], plan["model"]
    out = []
    out.append(
        "ranks (rank = pp·dp·mp + dp·mp + tp: TP fastest, then DP, then PP); bytes per rank, peak = "
        "params + grads + optimizer + activations + DeepSpeed's buffers"
    )
    hdr = (
        f"{'rank':>5} {'node':>4} {'host':<14} {'local':>5} {'pp':>3} {'dp':>3} {'tp':>3} {'params':>12} "
        f"{'params':>10} {'grads':>10} {'optimizer':>10} {'activations':>11} {'DS buffers':>10} {'peak':>10}"
    )
    out.append(hdr)
    shown = plan["ranks"]
    if len(shown) > RANK_ROWS:  # a row per rank of a 10⁶-rank world is 10⁶ lines: the ends, and --json has all
        shown = shown[: RANK_ROWS // 2] + [None] + shown[-RANK_ROWS // 4 :]
    for r in shown:
        if r is None:
            out.append(
                f"  … {len(plan['ranks']) - RANK_ROWS // 2 - RANK_ROWS // 4:,} more ranks: each has the bytes "
                f"of the ranks above with its pp and tp (--json lists every rank)"
            )
            continue
        out.append(
            f"{r['rank']:>5} {r['node']:>4} {r['host'][:14]:<14} {r['local_rank']:>5} {r['pp']:>3} "
            f"{r['dp']:>3} {r['tp']:>3} {r['params']:>12,} {human(r['param_bytes']):>10} "
            f"{human(r['grad_bytes']):>10} {human(r['optimizer_bytes']):>10} "
            f"{human(r['activation_bytes']):>11} {human(r['buffer_bytes']):>10} {human(r['total_bytes']):>10}"
        )
    half = M["precision"] != "fp32"
    if half:
        per_param = "fp16/bf16 params 2 B + grads 2 B + fp32 master and AdamW states 12 B"
    elif L["zero_stage"]:
        per_param = "fp32 params 4 B + grads 4 B + DeepSpeed's fp32 master copy and AdamW exp_avg/exp_avg_sq 12 B"
    else:
        per_param = "fp32 params 4 B + grads 4 B + AdamW exp_avg/exp_avg_sq 8 B"
    out.append(
        f"  {per_param}"
        f" per parameter; ZeRO {L['zero_stage']} divides "
        + {
            0: "nothing",
            1: "the optimizer state",
            2: "optimizer state and grads",
            3: "optimizer state, grads and params",
        }[L["zero_stage"]]
        + f" by dp = {L['data_parallel']}"
    )
    out.append(
        "  DS buffers: DeepSpeed's own (gradients flattened for the all-reduce, ZeRO's reduce buckets and fp32 "
        "gradient partition, fp32 gradient accumulation in half precision; gradients are reduced in fp32): "
        "model/costs.py"
    )
    return out


def _activation_lines(plan: dict) -> list[str]:
    """Activation memory per stage."""
    S = plan["stages"]
    out = []
    out.append("activations per rank (estimate, formula in model/costs.py)")
    out.append(f"{'stage':>5}  {'params/rank':>12}  {'per micro-batch':>15}  {'in flight':>9}  {'peak':>10}")
    for st in S:
        a = st["activations"]
        out.append(
            f"{st['stage']:>5}  {st['params_per_rank']:>12,}  {human(a['per_micro_batch']):>15}  "
            f"{a['in_flight']:>9}  {human(a['peak']):>10}"
        )
    return out


def _split_note(nx, mp) -> str:
    """How a stage boundary's tensors are divided among the TP ranks."""
    if mp == 1:
        return "one TP rank"
    if nx["pipe_partitioned"] and nx["grad_partitioned"]:
        return f"the float tensor and its gradient split over the {mp} TP ranks: 1/{mp} each"
    if nx["pipe_partitioned"]:
        return f"the float tensor split over the {mp} TP ranks, its gradient sent whole by each"
    return "each TP rank sends its own copy"


def _communication_lines(plan: dict) -> list[str]:
    """Tensor-parallel, pipeline and data-parallel bytes per rank per optimizer step."""
    L, S = plan["layout"], plan["stages"]
    out = []
    mb = L["micro_batch_num"]
    out.append(
        f"communication per optimizer step ({mb} micro-batch{'es' if mb > 1 else ''} of {L['micro_batch']}), per rank"
    )
    tpn = L["model_parallel"]
    if tpn == 1:
        out.append("  tensor parallel: mp = 1, none")
    for st in S if tpn > 1 else []:
        t = st["tp_allreduce"]
        loss = f" + {len(t['loss_elements'])} loss" if t["loss_elements"] else ""
        out.append(
            f"  tensor parallel, stage {st['stage']}: {len(t['forward_elements'])} forward + "
            f"{len(t['backward_elements'])} backward{loss} all-reduces per micro-batch = "
            f"{human(t['bytes_per_micro_batch'])}; per step {human(t['bytes_per_step'])} payload, "
            f"ring sends {human(t['sent_per_rank_per_step'])} (2·(mp-1)/mp × payload)"
        )
    for st in S:
        if "send_next" not in st:
            continue
        nx = st["send_next"]
        desc = ", ".join(f"{t['name']} [{','.join(map(str, t['shape']))}]" for t in nx["tensors"])
        out.append(
            f"  pipeline, stage {st['stage']} → {st['stage'] + 1}: forward {desc} = "
            f"{human(nx['forward_bytes_per_micro_batch'])}, backward gradients "
            f"{human(nx['backward_bytes_per_micro_batch'])} per micro-batch; per step "
            f"{human(nx['bytes_per_step'])} per TP rank ({_split_note(nx, L['model_parallel'])})"
        )
    if L["pipeline_stage"] == 1:
        out.append("  pipeline: pp = 1, none")
    for st in S:
        d = st["dp"]
        if L["data_parallel"] == 1:
            out.append(f"  data parallel: {d['how']}")
            break
        out.append(
            f"  data parallel, stage {st['stage']}: {human(d['bytes_per_step'])} sent per rank per step ({d['how']})"
        )
    return out


def format_memory(plan: dict) -> list[str]:
    """The memory verdict: per stage, its largest rank's peak against the device, and what would make it fit."""
    M = plan["memory"]
    usable = M["stages"][0]["usable_bytes"] if M["stages"] else 0
    out = [
        f"memory on {M['device']}: a stage fits when its largest rank's peak is at most "
        f"{100 * M['usable_fraction']:.0f}% of it = {human(usable)} (the rest: what the count leaves out, "
        f"docs/memory.md)"
    ]
    for v, st in zip(M["stages"], plan["stages"], strict=True):
        out.append(
            f"  stage {v['stage']}: peak {human(v['peak_bytes'])} → "
            + (
                "fits"
                if v["fits"]
                else f"DOES NOT FIT ({v['peak_bytes'] / max(usable, 1):.1f}× the usable "
                f"memory; activations {human(st['activations']['peak'])})"
            )
        )
    if all(v["fits"] for v in M["stages"]):
        return out
    if M["remedies"]:
        out.append("  it would fit with: " + "; ".join(M["remedies"]))
    else:
        out.append(
            "  no change tried fits (recompute, ZeRO stages, smaller micro-batches, twice the pipeline stages "
            "or tensor parallelism, each with recompute): use more GPUs per replica, a smaller model, or "
            "shorter sequences"
        )
    return out


def _x(ratio: float | None) -> str:
    return "∞" if ratio is None else f"{ratio:.1f}×"


def format_advice(plan: dict) -> list[str]:
    """The stage-balance flag and its re-planned remedies, and the small-batch note (training/plan/advice.py)."""
    A, world, out = plan.get("advice") or {}, plan["world_size"], []
    bal = A.get("balance")
    if bal and bal["flagged"]:
        r = bal["ratios"]
        names = {"params": "parameters", "peak_bytes": "peak memory", "flops": "compute"}
        parts = [
            f"{names[k]} stage {v['high_stage']} {_x(v['ratio'])} stage {v['low_stage']}"
            for k, v in r.items()
            if v["ratio"] is None or v["ratio"] > bal["threshold"]
        ]
        cause = ""
        if bal["cause"]:
            c = bal["cause"]
            cause = (
                f"; {c['embeddings_params'] / 1e6:.2f} M of stage 0's {c['stage_params'] / 1e6:.2f} M parameters "
                f"are the word tables replicated on every TP rank (vocab_emb_dp)"
            )
        out.append(f"  balance    UNEVEN STAGES: {', '.join(parts)} (flagged above {bal['threshold']}×){cause}")
        if bal["remedies"]:
            out.append(
                f"    remedies on the same {world} GPUs, each re-planned (parameters / peak memory / compute "
                f"ratio): "
                + "; ".join(
                    f"{m['change']}: {_x(m['ratios']['params'])} / {_x(m['ratios']['peak_bytes'])} / "
                    f"{_x(m['ratios']['flops'])}"
                    for m in bal["remedies"]
                )
            )
        else:
            out.append("    no split of the blocks or of the embeddings on these GPUs balances it better")
    sb = A.get("small_batch")
    if sb:
        out.append(
            f"  small batch  {sb['pairs_per_micro_batch']} pairs = {sb['tokens_per_micro_batch']:,} source "
            f"tokens per GPU per micro-batch (global batch {plan['layout']['global_batch']}, "
            f"{sb['pairs_per_dp_rank']} pairs per data-parallel rank): below {sb['threshold_tokens']:,} = "
            f"{sb['sms']} SMs × 128 × 128 / d_model {plan['model']['d_model']}, the rows a d_model-wide matrix "
            f"product needs to give every SM of the {sb['device']} one 128×128 output tile — so the step is "
            f"bound by kernel launches and latency, not compute; "
            f"{_more_pairs(plan, sb['batch_size_at_threshold'])} reaches it, or use fewer GPUs"
        )
    return out


def _more_pairs(plan: dict, pairs: int) -> str:
    """The flag that gives a global batch of `pairs`: --batch_size, or with token batches --max_tokens."""
    budget = plan.get("token_budget")
    return f"--max_tokens {token_budget.tokens_for(pairs, budget):,}" if budget else f"--batch_size {pairs}"
