"""plan.py: the layout, rank placement, per-rank bytes and communication it reports, checked against independent
hand calculations, the collectives the real TP model issues, and the shapes every rank of the 16pcs run builds."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from model import costs
from model.config import ModelConfig, ParallelConfig
from model.parallel.topology import ParallelContext, rank_map
from model.placement import layer_stages, place_blocks
from model.transformer import DecoderLayer, Embeddings, EncoderLayer, Head, block_specs
from tests.launch import run_python
from tests.progress import load_factor, scaled
from training.config.flags import parse_args
from training.config.sections import TrainConfig
from training.plan import planner as P
from training.plan.cluster import Host
from training.plan.report import format_plan

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
R16 = str(RECIPES / "16pcs" / "16pcs.json")


def args_for(*argv):
    return TrainConfig.from_flags(parse_args([str(a) for a in argv], parser=P.build_plan_parser()))


def plan_for(world, *argv, hosts=None):
    return P.make_plan(args_for(*argv), world, hosts)


# ------------------------------------------------------------------------------------ independent hand calculation


def hand_stage_params(V, h, f, S, T, tp, E, D, emb_dp, layers):
    """Closed-form parameter count of one rank holding `layers` (names as plan prints them), written from the
    architecture: LayerNorm 2h; column-parallel weight out/tp × in + bias out/tp; row-parallel weight out × in/tp
    + a replicated bias; the head has no bias and V rounded up to a multiple of tp rows."""
    Vp = -(-V // tp) * tp
    n = 0
    for name in layers:
        if name == "embeddings":
            rows = Vp // tp if (not emb_dp and tp > 1) else V
            n += 2 * rows * h + S * h + T * h
        elif name.startswith("encoder."):
            n += 2 * 2 * h  # ln1, ln2
            n += 3 * h * h // tp + 3 * h // tp  # fused QKV (column)
            n += h * h // tp + h  # attention out (row)
            n += f * h // tp + f // tp + h * f // tp + h  # fc1 (column), fc2 (row)
            if name == f"encoder.{E - 1}":
                n += 2 * h  # the encoder's final LayerNorm
        elif name.startswith("decoder."):
            n += 3 * 2 * h
            n += 3 * h * h // tp + 3 * h // tp + h * h // tp + h  # self-attention
            n += h * h // tp + h // tp + 2 * h * h // tp + 2 * h // tp + h * h // tp + h  # cross: q, kv, out
            n += f * h // tp + f // tp + h * f // tp + h
        elif name == "head":
            n += 2 * h + (Vp // tp) * h
    return n


def hand_bytes(n, dp, zero):
    part = -(-n // dp)
    return {
        "param_bytes": 4 * (part if zero >= 3 else n),
        "grad_bytes": 4 * (part if zero >= 2 else n),
        "optimizer_bytes": 12 * part if zero >= 1 else 8 * n,
    }  # ZeRO: + DeepSpeed's fp32 master copy


def test_seed_16pcs_count_by_hand():
    """The 16pcs numbers worked out on paper: stage 0 = 2×20000×128 + 20×128 + encoder, stage 1 = decoder + head."""
    enc = 4 * 128 * 128 // 8 + 2 * 128 * 128 // 8 + 3 * 16 + 16 + 6 * 128 + 2 * 128
    dec = 8 * 128 * 128 // 8 + 6 * 16 + 2 * 128 * 128 // 8 + 16 + 9 * 128
    assert 2 * 20000 * 128 + 20 * 128 + enc == 5_135_936
    assert dec + 2 * 128 + 2500 * 128 == 342_000
    plan = plan_for(16, "--recipe", R16)
    assert [s["params_per_rank"] for s in plan["stages"]] == [5_135_936, 342_000]


LAYOUTS = [
    # name, world, flags, (V, h, f, S, T, E, D)
    ("16pcs-zero1-pp2", 16, ["--recipe", R16], (20000, 128, 128, 10, 10, 1, 1)),
    (
        "dp4-mp2-zero2-splitvocab",
        8,
        [
            "--vocab_size",
            "20001",
            "--d_model",
            "64",
            "--ffn_size",
            "96",
            "--mp",
            "2",
            "--zero_stage",
            "2",
            "--vocab_emb_dp",
            "0",
            "--encoder_layer",
            "2",
            "--decoder_layer",
            "2",
            "--src_len",
            "12",
            "--tgt_len",
            "9",
        ],
        (20001, 64, 96, 12, 9, 2, 2),
    ),
    (
        "dp2-mp2-pp2-zero1",
        8,
        [
            "--vocab_size",
            "1000",
            "--d_model",
            "32",
            "--num_heads",
            "4",
            "--mp",
            "2",
            "--pipeline_stage",
            "2",
            "--micro_batch_num",
            "2",
            "--enable_parallel_optimizer",
            "1",
            "--encoder_layer",
            "3",
            "--decoder_layer",
            "1",
        ],
        (1000, 32, 32, 10, 10, 3, 1),
    ),
    (
        "dp4-zero3",
        4,
        ["--vocab_size", "999", "--d_model", "48", "--num_heads", "4", "--zero_stage", "3"],
        (999, 48, 48, 10, 10, 1, 1),
    ),
]


@pytest.mark.parametrize("name,world,flags,dims", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_bytes_match_hand_calculation(name, world, flags, dims):
    V, h, f, S, T, E, D = dims
    plan = plan_for(world, *flags)
    L = plan["layout"]
    tp, dp, zero = L["model_parallel"], L["data_parallel"], L["zero_stage"]
    assert tp * dp * L["pipeline_stage"] == world
    for r in plan["ranks"]:
        layers = plan["stages"][r["pp"]]["layers"]
        n = hand_stage_params(V, h, f, S, T, tp, E, D, L["vocab_emb_dp"], layers)
        assert r["params"] == n, (r["rank"], layers)
        want = hand_bytes(n, dp, zero)
        assert {k: r[k] for k in want} == want, r
        assert r["state_bytes"] == sum(want.values())
        # the peak counts the activations of its stage and DeepSpeed's buffers too
        assert r["total_bytes"] == (
            sum(want.values())
            + plan["stages"][r["pp"]]["activations"]["peak"]
            + r["buffers"]["during_backward"]
            + r["buffers"]["after_backward"]
        )
    # every layer sits on exactly one stage, in order
    all_layers = [x for s in plan["stages"] for x in s["layers"]]
    assert all_layers == ["embeddings"] + [f"encoder.{i}" for i in range(E)] + [f"decoder.{i}" for i in range(D)] + [
        "head"
    ]


def test_zero_and_pipeline_traffic_by_hand():
    # dp 4 × mp 2, ZeRO 2, one micro-batch: the fp32 gradient buckets all-reduced whole (DeepSpeed's
    # use_multi_rank_bucket_allreduce) 2·3/4·G per micro-batch + all-gather 3/4·P per step
    plan = plan_for(8, *LAYOUTS[1][2])
    n = plan["stages"][0]["params_per_rank"]
    assert plan["stages"][0]["dp"]["bytes_per_step"] == round(2 * 0.75 * 4 * n + 0.75 * 4 * n)
    assert plan["stages"][0]["dp"]["grad_bytes_per_step"] == round(2 * 0.75 * 4 * n)
    # dp 2 × mp 2 × pp 2, ZeRO 1: blocks [enc0, enc1 | enc2, dec0] → the cut is inside the encoder
    plan = plan_for(8, *LAYOUTS[2][2])
    s0, s1 = plan["stages"]
    assert s0["layers"] == ["embeddings", "encoder.0", "encoder.1"]
    assert s1["layers"] == ["encoder.2", "decoder.0", "head"]
    b, s, t, h = 32 // (2 * 2), 10, 10, 32
    nxt = s0["send_next"]
    # one float (the two hidden tensors joined: model.pipeline), split over the 2 TP ranks both ways, and the ids
    assert [x["name"] for x in nxt["tensors"]] == ["src_h+tgt_h", "src_ids", "tgt_ids"]
    assert nxt["pipe_partitioned"] and nxt["grad_partitioned"]
    assert nxt["forward_bytes_per_micro_batch"] == 4 * b * (s + t) * h // 2 + 8 * b * (s + t)
    assert nxt["backward_bytes_per_micro_batch"] == 4 * b * (s + t) * h // 2
    assert nxt["bytes_per_step"] == 2 * (4 * b * (s + t) * h + 8 * b * (s + t))
    r = 1 / 2
    for st in plan["stages"]:  # ZeRO 1: bucket all-reduce 2r·G + all-gather r·P, once per step
        G = 4 * st["params_per_rank"]
        assert st["dp"]["bytes_per_step"] == round(2 * r * G + r * G)
    # 16pcs: the cut after the (last) encoder sends (tgt_h and memory joined, ids), 1/8 of the float per TP rank
    nxt = plan_for(16, "--recipe", R16)["stages"][0]["send_next"]
    assert [x["name"] for x in nxt["tensors"]] == ["tgt_h+memory", "src_ids", "tgt_ids"]
    assert nxt["forward_bytes_per_micro_batch"] == 4 * 16 * 20 * 128 // 8 + 8 * 16 * 20


def test_half_precision_gradients_travel_in_fp32_by_hand(tmp_path):
    """Data-parallel bytes per step and rank when the weights are half: gradients cross the wire in fp32 (4 bytes),
    the parameters DeepSpeed all-gathers in the training precision (2 bytes); r = (dp-1)/dp."""

    def dp_of(world, *flags):
        st = plan_for(world, *SMALL, *flags)["stages"][0]
        return st["params_per_rank"], st["dp"]

    # bf16 at ZeRO 0 is BF16_Optimizer: all-reduce of the fp32 gradients + all-gather of the bf16 parameters
    n, d = dp_of(2, "--precision", "bf16")
    assert (d["grad_bytes_per_step"], d["param_bytes_per_step"]) == (round(2 * 0.5 * 4 * n), round(0.5 * 2 * n))
    # fp16 ZeRO 2, 2 micro-batches: the fp32 buckets all-reduced every micro-batch
    n, d = dp_of(2, "--precision", "fp16", "--zero_stage", 2, "--micro_batch_num", 2)
    assert (d["grad_bytes_per_step"], d["param_bytes_per_step"]) == (round(2 * 2 * 0.5 * 4 * n), round(0.5 * 2 * n))
    # bf16 ZeRO 3 at dp 4, 2 micro-batches: per micro-batch a reduce-scatter of the fp32 gradients and the bf16
    # parameters gathered in forward and backward
    n, d = dp_of(4, "--precision", "bf16", "--zero_stage", 3, "--micro_batch_num", 2)
    assert (d["grad_bytes_per_step"], d["param_bytes_per_step"]) == (
        round(2 * 0.75 * 4 * n),
        round(2 * 2 * 0.75 * 2 * n),
    )
    # a DeepSpeed config that reduces each slice to its owner instead of all-reducing whole buckets: r·G
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"use_multi_rank_bucket_allreduce": False}}))
    n, d = dp_of(2, "--precision", "fp16", "--deepspeed_config", ds)
    assert d["grad_bytes_per_step"] == round(0.5 * 4 * n) and "to its owner" in d["how"]


# ---------------------------------------------------------------------- TP collectives: plan vs the real model

B, S, T = 3, 7, 6


def _commlog_case(rank, world, cfg, vocab_emb_dp, recompute):
    from model.parallel.mappings import CommLog
    from model.transformer import Seq2SeqTransformer
    from tests.test_tp_layers import tp_context

    ctx = tp_context(world)
    par = Seq2SeqTransformer(
        cfg, ParallelConfig(model_parallel=world, vocab_emb_dp=vocab_emb_dp, recompute=recompute), ctx, seed=1
    )
    par.train()
    g = torch.Generator().manual_seed(0)
    src, tgt, labels = (torch.randint(4, cfg.vocab_size, (B, n), generator=g) for n in (S, T, T))
    with CommLog() as fwd:
        loss = par.loss_sum(src, tgt, labels)
    with CommLog() as bwd:
        loss.backward()
    return fwd.calls, bwd.calls


@pytest.mark.parametrize("vocab_emb_dp,recompute", [(True, False), (False, True)])
def test_tp_allreduces_match_commlog(vocab_emb_dp, recompute):
    """plan's list of TP all-reduces is exactly what the model issues (counted by CommLog on 2 real ranks)."""
    cfg = ModelConfig(
        vocab_size=51,
        d_model=16,
        num_heads=4,
        ffn_size=24,
        encoder_layers=2,
        decoder_layers=3,
        src_len=S,
        tgt_len=T,
        dropout=0.0,
        attention_dropout=0.0,
    )
    fwd, bwd = run_ranks_cached(cfg, vocab_emb_dp, recompute)
    parallel = ParallelConfig(model_parallel=2, vocab_emb_dp=vocab_emb_dp, recompute=recompute)
    want = costs.tp_allreduces(cfg, parallel, P.layer_names(cfg), micro=B)
    assert sorted(n for op, n in fwd if op == "all_reduce") == sorted(want["forward"])
    assert [n for op, n in fwd if op == "loss_all_reduce"] == want["loss"]
    assert sorted(n for op, n in bwd if op == "all_reduce") == sorted(want["backward"])
    assert all(op in ("all_reduce", "loss_all_reduce") for op, _ in fwd + bwd)


def run_ranks_cached(cfg, vocab_emb_dp, recompute):
    from tests.multiproc import run_ranks

    results = run_ranks(2, _commlog_case, cfg, vocab_emb_dp, recompute)
    assert results[0] == results[1]
    return results[0]


# ------------------------------------------------------------------------- the 16pcs run, rank by rank, no group


def test_16pcs_every_rank_builds_its_stage_and_shards():
    """All 16 ranks of the seed's cluster run, each built as that rank builds it (ParallelContext(tp_size=8,
    tp_rank=r), no process group), with the shapes a 8-way split must give."""
    args = parse_args(["--recipe", R16], parser=P.build_plan_parser())
    world = 16
    model = ModelConfig(
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        num_heads=args.num_heads,
        encoder_layers=args.encoder_layer,
        decoder_layers=args.decoder_layer,
        src_len=args.src_len,
        tgt_len=args.tgt_len,
    )
    parallel = ParallelConfig.for_world(
        world,
        model_parallel=args.model_parallel,
        pipeline_stage=args.pipeline_stage,
        micro_batch_num=args.micro_batch_num,
        optimizer_shard=True,
    )
    assert (parallel.data_parallel, parallel.model_parallel, parallel.pipeline_stage) == (1, 8, 2)
    placements = place_blocks(model, parallel)
    stages = layer_stages(model, parallel, [p.pipeline_stage for p in placements])
    assert stages == [0, 0, 1, 1]  # embeddings, encoder.0 | decoder.0, head
    d, mp = 128, 8
    seen = set()
    for c in rank_map(parallel):
        assert c.rank == c.pp * 8 + c.tp and c.dp == 0
        ctx = ParallelContext(tp_size=mp, tp_rank=c.tp, tp_group=None, pp_size=2, pp_rank=c.pp)
        specs = block_specs(model, parallel, ctx, 1234, placements)
        mods = [cls(**kw) for (cls, kw), s in zip(specs, stages, strict=True) if s == c.pp]
        kinds = [type(m) for m in mods]
        if c.pp == 0:
            assert kinds == [Embeddings, EncoderLayer]
            emb, enc = mods
            assert emb.src_word.weight.shape == (20000, d)  # vocab_emb_dp: whole table on every rank
            assert emb.src_pos.shape == (10, d)
            assert enc.attn.qkv.weight.shape == (3 * d // mp, d)  # 3·d/mp rows: one head's q, k, v
            assert enc.attn.out.weight.shape == (d, d // mp)
            assert enc.mlp.fc1.weight.shape == (d // mp, d) and enc.mlp.fc2.weight.shape == (d, d // mp)
            assert enc.final_ln is not None
        else:
            assert kinds == [DecoderLayer, Head]
            dec, head = mods
            assert dec.self_attn.qkv.weight.shape == (3 * d // mp, d)
            assert dec.cross_attn.q.weight.shape == (d // mp, d) and dec.cross_attn.kv.weight.shape == (2 * d // mp, d)
            assert dec.last and dec.last_on_stage
            assert head.proj.weight.shape == (model.padded_vocab(mp) // mp, d) == (2500, d)
            assert head.proj.bias is None
        n = sum(p.numel() for m in mods for p in m.parameters())
        seen.add((c.pp, n))
    assert seen == {(0, 5_135_936), (1, 342_000)}


# --------------------------------------------------------------------------------------- placement and scale


def test_16pcs_plan_world16_and_hostfile():
    plan = plan_for(16, "--recipe", R16)
    L = plan["layout"]
    assert (L["data_parallel"], L["model_parallel"], L["pipeline_stage"], L["zero_stage"]) == (1, 8, 2, 1)
    assert (L["micro_batch"], L["micro_batch_num"]) == (16, 2)
    assert [s["layers"] for s in plan["stages"]] == [["embeddings", "encoder.0"], ["decoder.0", "head"]]
    assert [(r["rank"], r["node"], r["pp"], r["dp"], r["tp"]) for r in plan["ranks"]] == [
        (r, r // 8, r // 8, 0, r % 8) for r in range(16)
    ]
    assert L["tp_groups_spanning_nodes"] == 0
    # a hostfile decides the nodes: 4 + 12 slots puts TP group 0 across both hosts
    hosts = [Host("a", 4), Host("b", 12)]
    plan = plan_for(16, "--recipe", R16, hosts=hosts)
    assert [r["host"] for r in plan["ranks"]] == ["a"] * 4 + ["b"] * 12
    assert [r["local_rank"] for r in plan["ranks"]][:6] == [0, 1, 2, 3, 0, 1]
    assert plan["layout"]["tp_groups_spanning_nodes"] == 1
    assert "1 TP group(s) span nodes" in format_plan(plan)


def test_rank_map_world_64_in_milliseconds():
    parallel = ParallelConfig(data_parallel=4, model_parallel=8, pipeline_stage=2)
    t = time.perf_counter()
    coords = rank_map(parallel)
    ms = (time.perf_counter() - t) * 1000
    print(f"rank_map(64) took {ms:.2f} ms")
    assert ms < scaled(200)
    assert [c.rank for c in coords] == list(range(64))
    for c in coords:  # TP fastest, then DP, then PP
        assert c.rank == c.pp * 32 + c.dp * 8 + c.tp
    assert len({(c.pp, c.dp, c.tp) for c in coords}) == 64


def test_plan_64_ranks_in_seconds():
    t = time.perf_counter()
    plan = plan_for(64, "--recipe", R16)
    text = format_plan(plan)
    seconds = time.perf_counter() - t
    print(f"plan for 64 ranks: {seconds:.2f} s")
    assert seconds < scaled(10), f"{seconds:.1f} s at load factor {load_factor():.1f}"
    assert plan["layout"]["data_parallel"] == 4 and len(plan["ranks"]) == 64
    assert text.count("\n   63    7 node7") == 1
    # ZeRO 1 over dp 4: the optimizer state (master copy + 2 moments) is a quarter, params and grads are whole
    r0 = plan["ranks"][0]
    assert r0["optimizer_bytes"] == 12 * -(-r0["params"] // 4) and r0["grad_bytes"] == 4 * r0["params"]


def test_rank_map_is_deepspeeds_topology():
    """rank_map computes what DeepSpeed's PipeModelDataParallelTopology looks up (the grid the engine builds)."""
    from model.parallel.topology import make_topology

    for dp, tp, pp in [(1, 1, 1), (2, 4, 1), (3, 2, 2), (1, 8, 2), (4, 1, 3), (2, 2, 4)]:
        parallel = ParallelConfig(data_parallel=dp, model_parallel=tp, pipeline_stage=pp)
        topo = make_topology(parallel)
        assert [(c.pp, c.dp, c.tp) for c in rank_map(parallel)] == [
            (topo.get_coord(r).pipe, topo.get_coord(r).data, topo.get_coord(r).model) for r in range(dp * tp * pp)
        ]


def test_a_million_ranks_plan_in_seconds():
    """The plan is linear in the world (65,536 ranks took 41 s when rank_map searched DeepSpeed's rank table for
    every rank, and 10⁶ would take hours); the text report prints the ends of the rank table, --json every row."""
    world = 2**20
    t = time.perf_counter()
    plan = plan_for(world, "--recipe", R16, "--batch_size", str(2 * world))
    text = format_plan(plan)
    seconds = time.perf_counter() - t
    print(f"plan for {world:,} ranks: {seconds:.2f} s")
    assert seconds < scaled(30), f"{seconds:.1f} s at load factor {load_factor():.1f}"
    assert len(plan["ranks"]) == world and plan["layout"]["data_parallel"] == world // 16
    last = plan["ranks"][-1]
    assert (last["rank"], last["pp"], last["dp"], last["tp"], last["node"]) == (
        world - 1,
        1,
        world // 16 - 1,
        7,
        world // 8 - 1,
    )
    assert last["total_bytes"] == plan["ranks"][world // 2 + 7]["total_bytes"]  # the same (stage, tp rank)
    assert f"{world - 1:>5} {world // 8 - 1:>4} node{world // 8 - 1}" in text and "more ranks" in text
    assert plan["layout"]["dp_groups_spanning_nodes"] == 16 and plan["layout"]["tp_groups_spanning_nodes"] == 0
    assert len(text.splitlines()) < 400


def test_groups_spanning_nodes_with_uneven_hosts():
    plan = plan_for(
        16,
        "--recipe",
        R16,
        "--mp",
        "4",
        "--pipeline_stage",
        "1",
        "--batch_size",
        "32",
        hosts=[Host("a", 6), Host("b", 10)],
    )
    # TP groups 0-3, 4-7 (spans a/b), 8-11, 12-15; DP groups {t, t+4, t+8, t+12}: each spans both hosts
    assert plan["layout"]["tp_groups_spanning_nodes"] == 1 and plan["layout"]["dp_groups_spanning_nodes"] == 4
    rows = plan["ranks"]
    assert [r["rank"] for r in rows[-3:]] == [13, 14, 15] and rows[5]["host"] == "a" and rows[6]["host"] == "b"


def test_a_model_too_large_for_any_tensor_is_one_line(assert_user_error):
    """--d_model 1000000000 traced back inside torch's size arithmetic (building the blocks on the meta device)."""
    proc = run_plan("--recipe", R16, "--world_size", "16", "--d_model", "1000000000")
    assert proc.returncode == 2
    assert_user_error(proc, "d_model=1000000000", "choose smaller sizes")
    for flag in (["--device_memory", "inf"], ["--d_model", "1e9"]):
        proc = run_plan("--recipe", R16, "--world_size", "16", *flag)
        assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: {flag[0]} {flag[1]} must be")


@pytest.mark.parametrize(
    "name,world,extra",
    [
        ("2pcs", 2, []),
        ("8pcs", 8, []),
        ("8pcs-dp2-mp4", 8, []),
        ("16pcs", 16, []),
        ("cpu-tiny", 2, ["--vocab_size", "2000"]),
    ],
)
def test_every_recipe_plans_at_its_world(name, world, extra):
    args = args_for("--recipe", RECIPES / name / f"{name}.json", *extra)
    plan = P.make_plan(args, world)
    assert plan["world_size"] == world
    assert P.check_line(args, world).startswith(f"layout ok: {world} ranks")


# --------------------------------------------------------------------------------------------- error messages


def write(tmp_path, body, name="r.json"):
    path = tmp_path / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


SEED_MODEL = {"vocab_size": 20000, "d_model": 128, "num_heads": 8, "encoder_layer": 1, "decoder_layer": 1}
BAD = [
    # name, recipe body, world, message fragments
    (
        "world-mismatch",
        None,
        8,
        ["1×8×2 = 16 but the world has 8 processes", "Layouts that fit 8 processes: dp=1 mp=8 pp=1"],
    ),
    (
        "heads-not-divisible",
        {"model": SEED_MODEL, "parallel": {"model_parallel": 3}},
        3,
        ["num_heads=8 is not divisible by model_parallel=3", "one of [1, 2, 4, 8]"],
    ),
    ("too-many-stages", {"model": SEED_MODEL, "parallel": {"pipeline_stage": 3}}, 3, ["pipeline_stage=3 > 2 blocks"]),
    (
        "batch-not-divisible",
        {"model": SEED_MODEL, "parallel": {"model_parallel": 2}, "training": {"batch_size": 30}},
        8,
        ["global batch_size=30 is not divisible by data_parallel×micro_batch_num = 4×1 = 4", "try batch_size 28 or 32"],
    ),
    (
        "zero2-with-pipeline",
        {"model": SEED_MODEL, "parallel": {"pipeline_stage": 2, "zero_stage": 2}},
        2,
        ["ZeRO stage 2 cannot be combined with pipeline_stage=2"],
    ),
    ("malformed-json", '{"model": {"vocab_size": 20000,}}', 2, ["is not valid JSON: line 1 column"]),
    ("unknown-key", {"model": SEED_MODEL, "parallel": {"model_paralel": 2}}, 2, ["unknown key parallel.model_paralel"]),
    ("unknown-section", {"modle": SEED_MODEL}, 2, ["unknown section 'modle'"]),
    (
        "wrong-type",
        {"model": SEED_MODEL, "parallel": {"model_parallel": 2.5}},
        2,
        ["parallel.model_parallel is 2.5; it must be an integer"],
    ),
    # no vocab_size: the tokenizer's, as train.py takes it (tests/test_front_door.py); a --tokenizer that is not there
    (
        "no-tokenizer",
        {"model": {"d_model": 32, "num_heads": 4, "tokenizer": "nowhere/tokenizer.json"}},
        2,
        ["nowhere/tokenizer.json: tokenizer file not found"],
    ),
    (
        "deepspeed-batch-clash",
        {"model": SEED_MODEL, "deepspeed": {"train_batch_size": 64}},
        1,
        ["DeepSpeed config sets train_batch_size=64 but the flags give 32"],
    ),
]


@pytest.mark.parametrize("name,body,world,needles", BAD, ids=[c[0] for c in BAD])
def test_bad_recipe_messages(name, body, world, needles, tmp_path):
    recipe = R16 if body is None else write(tmp_path, body)
    with pytest.raises(UserError) as e:
        P.main(["--recipe", str(recipe), "--world_size", str(world)])
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_world_and_hostfile_errors(tmp_path, capsys):
    assert P.main(["--recipe", R16, "--check"]) == 0  # the recipe's world_size, 16
    assert capsys.readouterr().out.startswith("layout ok: 16 ranks")
    with pytest.raises(UserError, match='give the world to plan for.*or a recipe whose "parallel" section says'):
        P.main(["--recipe", str(REPO / "recipes/multi30k-en-fr/multi30k-en-fr.json")])  # (any world size)
    hf = write(tmp_path, "a slots=8\nb slots=4\n", "hostfile")
    with pytest.raises(UserError, match="--world_size 16 but the hostfile .* has 12 slots"):
        P.main(["--recipe", R16, "--world_size", "16", "--hostfile", str(hf)])
    with pytest.raises(UserError, match="but the world has 12 processes"):
        P.main(["--recipe", R16, "--hostfile", str(hf)])
    with pytest.raises(UserError, match="hostfile .*missing.* not found"):
        P.main(["--recipe", R16, "--hostfile", str(tmp_path / "missing")])


# ------------------------------------------------------------------------------- the CLI: clean stdout, one error


def run_plan(*args):
    return run_python([sys.executable, str(REPO / "run_scripts" / "plan.py"), *map(str, args)], cwd=REPO, timeout=120)


def test_cli_json_and_text(tmp_path):
    proc = run_plan("--recipe", R16, "--hostfile", REPO / "run_scripts" / "hostfiles" / "hostfile_2nodes", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)  # nothing but JSON on stdout
    assert [r["host"] for r in plan["ranks"]] == ["192.0.2.10"] * 8 + ["192.0.2.11"] * 8


def test_cli_bad_recipe_is_one_error_line(assert_user_error):
    proc = run_plan("--recipe", R16, "--world_size", "8")
    assert proc.returncode == 2
    assert_user_error(proc, "but the world has 8 processes", "Layouts that fit 8 processes")


def test_deepspeed_buckets_follow_the_fusion_groups_up_to_a_cap():
    """gradient_aggregation_group (the seed's fusion groups) splits the gradients into that many buckets, but no
    bucket exceeds BUCKET_CAP_BYTES: a 1.3 B-parameter model does not get 1.3 GB buckets (DeepSpeed's default would
    be 2 GB)."""
    from training.core.engine import BUCKET_CAP_BYTES, bucket_elements, deepspeed_config

    assert bucket_elements(1_000_000, 4) == 250_000
    assert bucket_elements(1_000_001, 4) == 250_002  # 250,001 rounded up to DeepSpeed's alignment (2)
    assert bucket_elements(1_300_000_000, 4) * 4 == BUCKET_CAP_BYTES == 100 * 2**20
    cfg = deepspeed_config(ParallelConfig(data_parallel=2, optimizer_shard=True), 32, "fp32", 0.0, 1_300_000_000)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == BUCKET_CAP_BYTES // 4
    assert cfg["zero_optimization"]["allgather_bucket_size"] == BUCKET_CAP_BYTES // 4


def test_zero_overlap_defaults_follow_the_device():
    """GPUs get what DeepSpeed recommends (communication overlapped with the backward pass, contiguous gradients),
    CPUs what measured fastest there (both off); a recipe's "deepspeed" section still decides."""
    from training.core.engine import deepspeed_config

    zero1 = ParallelConfig(data_parallel=2, optimizer_shard=True)
    for device, on in (("cuda", True), ("cpu", False)):
        z = deepspeed_config(zero1, 32, "fp32", 0.0, 1000, device_type=device)["zero_optimization"]
        assert z["overlap_comm"] is on and z["contiguous_gradients"] is on, (device, z)
    mine = deepspeed_config(
        zero1, 32, "fp32", 0.0, 1000, {"zero_optimization": {"overlap_comm": False}}, device_type="cuda"
    )
    assert mine["zero_optimization"]["overlap_comm"] is False
    # a pipeline reduces after its last micro-batch and DeepSpeed disables overlap_comm for it: the config says so
    piped = ParallelConfig(data_parallel=2, pipeline_stage=2, micro_batch_num=2, optimizer_shard=True)
    z = deepspeed_config(piped, 32, "fp32", 0.0, 1000, device_type="cuda")["zero_optimization"]
    assert (z["overlap_comm"], z["contiguous_gradients"]) == (False, True)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("zero,pp", [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2)])
def test_every_generated_config_reduces_gradients_in_fp32(precision, zero, pp):
    """DeepSpeed reduces in the training precision unless communication_data_type says otherwise: the generated
    config says fp32 for every precision, ZeRO stage and pipeline (what each optimizer does with it: docs/
    parallelism.md; the collectives themselves: tests/test_grad_reduce_dtype.py)."""
    from training.core.engine import deepspeed_config

    parallel = ParallelConfig(data_parallel=2, pipeline_stage=pp, micro_batch_num=pp, zero_stage=zero)
    for device in ("cpu", "cuda"):
        assert (
            deepspeed_config(parallel, 32, precision, 1.0, 1000, device_type=device)["communication_data_type"]
            == "fp32"
        )


def test_buckets_are_even_for_every_parameter_count_and_group_number():
    """DeepSpeed's ZeRO 1/2 optimizer asserts allgather_bucket_size % 2 == 0; ceil(params / groups) is often odd
    (d_model 100, 4 heads, vocab 20,001 gave one), which failed fp32 ZeRO-1/2 and every fp16 run at start. Every
    bucket is even, covers its share of the gradients, and exceeds it by at most the alignment."""
    from training.core.engine import BUCKET_ALIGNMENT, BUCKET_CAP_BYTES, GRAD_BYTES, bucket_elements

    cap = BUCKET_CAP_BYTES // GRAD_BYTES
    for n in [1, 2, 3, 5, 7, 99, 1001, 20_001 * 100 + 7, 3_366_301, 2**31 + 1]:
        for groups in range(1, 17):
            size = bucket_elements(n, groups)
            share = min(-(-n // groups), cap)
            assert size % BUCKET_ALIGNMENT == 0 and share <= size < share + BUCKET_ALIGNMENT, (n, groups, size)


def _zero1_with_an_odd_share(rank, world):
    """Real DeepSpeed ZeRO-1 (fp32) over a model whose gradient count / groups is odd (7 / 1)."""
    import deepspeed

    from model.parallel.topology import skip_shm_all_reduce
    from training.core.engine import deepspeed_config

    skip_shm_all_reduce()  # as train.py: no C++ build of DeepSpeed's CPU shm all-reduce
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=True)
    model.extra = torch.nn.Parameter(torch.zeros(3))  # 4 + 3 = 7 gradient elements
    parallel = ParallelConfig(data_parallel=world, optimizer_shard=True, gradient_aggregation_group=1)
    cfg = deepspeed_config(parallel, 2 * world, "fp32", 0.0, 7)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    loss = engine(torch.ones(2, 3)).sum() + engine.module.extra.sum()
    engine.backward(loss)
    engine.step()
    return type(engine.optimizer).__name__, cfg["zero_optimization"]["allgather_bucket_size"]


def test_zero1_starts_when_the_gradient_share_is_odd():
    from tests.multiproc import run_ranks

    for name, bucket in run_ranks(2, _zero1_with_an_odd_share):
        assert name == "DeepSpeedZeroOptimizer" and bucket == 8


# ------------------------------------------------------------------- FLOPs: the cost model vs torch's own count


@pytest.mark.parametrize("padded", [False, True])
def test_flops_model_equals_torch_flop_counter(padded):
    """model.costs.model_flops (forward + backward of a step) equals what torch's FlopCounterMode counts on the
    model itself — every matrix product, attention included (the math SDPA backend, whose products it sees) — with
    and without padding (projections on real tokens only, attention on the padded layout)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from model.transformer import Seq2SeqTransformer

    cfg = ModelConfig(
        vocab_size=60,
        d_model=32,
        num_heads=4,
        ffn_size=48,
        encoder_layers=2,
        decoder_layers=3,
        src_len=9,
        tgt_len=7,
        dropout=0.0,
        attention_dropout=0.0,
        pad_id=0,
    )
    model = Seq2SeqTransformer(cfg, seed=1)
    g = torch.Generator().manual_seed(0)
    src, tgt, labels = (torch.randint(4, 60, (5, n), generator=g) for n in (9, 7, 7))
    if padded:
        src[0, 5:] = 0
        tgt[1, 3:] = 0
        labels[1, 3:] = 0
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.loss_sum(src, tgt, labels).backward()
    want = costs.model_flops(cfg, int((src != 0).sum()), int((tgt != 0).sum()), 5, 9, 7)
    assert counter.get_total_flops() == want


def test_packing_follows_ids_written_in_place():
    """The real-token index is cached on the ids tensor; writing the tensor in place invalidates it."""
    from model.packing import Packing

    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert Packing.of(ids, 0).tokens == 3
    ids[1, 1] = 9
    assert Packing.of(ids, 0).tokens == 4 and Packing.of(ids, 0).index.tolist() == [0, 1, 3, 4]


def test_packing_of_parts_joins_to_the_whole_and_follows_writes():
    """The interleave parts' packings, kept on the ids tensor, join to exactly the whole batch's packing (no second
    nonzero); a write to the ids invalidates the parts too."""
    from model.packing import Packing

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 9, (6, 5), generator=g)
    ids[0, 2:], ids[3, 1:], ids[5, 4:] = 0, 0, 0
    want = Packing(ids, 0)
    parts = Packing.parts(ids, 0, 3)
    assert Packing.parts(ids, 0, 3) is parts  # kept: the next layer gets the same ones
    assert [p.index.tolist() for p in parts] == [Packing(c, 0).index.tolist() for c in ids.chunk(3)]
    whole = Packing.of(ids, 0)
    assert whole.index.tolist() == want.index.tolist() and (whole.batch, whole.length, whole.tokens) == (
        want.batch,
        want.length,
        want.tokens,
    )
    ids[3, 2] = 4
    assert Packing.parts(ids, 0, 3) is not parts
    assert Packing.of(ids, 0).index.tolist() == Packing(ids, 0).index.tolist() != want.index.tolist()


def test_peak_flops_are_known_for_listed_gpus_only():
    assert costs.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert costs.peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert costs.peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert costs.peak_flops("cpu", "fp32") is None and costs.peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None


# ------------------------------------------------------------------------------------------ the memory verdict

SMALL = ("--vocab_size", 1000, "--d_model", 64, "--num_heads", 4)
PP2 = ("--pipeline_stage", 2, "--micro_batch_num", 2)
# (world, flags, device, hand-worked buffers of a rank with n parameters, reduce bucket b = min(n/4, n) elements
# (gradient_aggregation_group 4), partition p = ⌈n/dp⌉, largest block L). Gradients are reduced in fp32 under every
# precision (4 bytes an element on the wire and in the reduction buffers).
BUFFER_CASES = [
    # fp32 ZeRO 0: all gradients flattened for the all-reduce after backward, even at dp 1
    (1, [], "cpu", lambda n, b, p, L: (0, 4 * n)),
    # fp32 ZeRO 1 on a CPU: the bucket flattened after backward, the fp32 partition the optimizer steps
    (2, ["--enable_parallel_optimizer", 1], "cpu", lambda n, b, p, L: (0, 4 * b + 4 * p)),
    # on a GPU (overlap_comm, contiguous_gradients): two contiguous fp32 bucket buffers, and the flattened bucket
    # reduced in the last micro-batch's backward
    (2, ["--enable_parallel_optimizer", 1], "cuda", lambda n, b, p, L: (2 * 4 * b + 4 * b, 4 * p)),
    (2, ["--zero_stage", 2], "cuda", lambda n, b, p, L: (3 * 4 * b, 4 * p)),
    # a pipeline runs without overlap (DeepSpeed turns it off): one contiguous buffer, the reduction after backward
    (4, [*PP2, "--enable_parallel_optimizer", 1], "cuda", lambda n, b, p, L: (4 * b, 4 * b + 4 * p)),
    # bf16 at ZeRO 0/1 is BF16_Optimizer: its fp32 accumulation (n·4) and its fp32 gradients flattened for the
    # all-reduce (n·4, no bf16 copy) — no reduce bucket, no overlap; pipelined alike
    (1, ["--precision", "bf16"], "cuda", lambda n, b, p, L: (4 * n, 4 * n)),
    (4, [*PP2, "--precision", "bf16"], "cuda", lambda n, b, p, L: (4 * n, 4 * n)),
    # fp16 at ZeRO 0 runs the ZeRO 1 optimizer: fp32 grad_accum copies (n·4) staged in two fp32 bucket buffers,
    # the flattened bucket (fp32 already), the fp32 partition
    (2, ["--precision", "fp16"], "cuda", lambda n, b, p, L: (4 * n + 2 * 4 * b + 4 * b, 4 * p)),
    # bf16 ZeRO 2 stages the bf16 gradients: two bf16 bucket buffers, the bucket flattened in bf16 (b·2) and cast to
    # fp32 for the reduction (b·4), and the fp32 partition where the reduced gradients accumulate, from the first
    # micro-batch on
    (2, ["--precision", "bf16", "--zero_stage", 2], "cuda", lambda n, b, p, L: (2 * 2 * b + 2 * b + 4 * b + 4 * p, 0)),
    (2, ["--precision", "bf16", "--zero_stage", 2], "cpu", lambda n, b, p, L: (2 * b + 4 * b + 4 * p, 0)),
    # bf16 ZeRO 3: its bucket buffer is of the communication dtype (fp32), concatenated for the reduce-scatter, the
    # fp32 gradient partitions, and the largest block plus the 5e7-element prefetch bucket gathered in bf16
    (
        2,
        ["--precision", "bf16", "--zero_stage", 3],
        "cuda",
        lambda n, b, p, L: (4 * b + 4 * b + 4 * p + 2 * (L + min(50_000_000, n)), 0),
    ),
]


@pytest.mark.parametrize(
    "world,flags,device,want",
    BUFFER_CASES,
    ids=[f"{w}-{'_'.join(map(str, f)) or 'fp32'}-{d}" for w, f, d, _ in BUFFER_CASES],
)
def test_deepspeed_buffers_by_hand(world, flags, device, want):
    """What DeepSpeed 0.19.8 allocates beyond params / grads / optimizer state, per optimizer, with gradients
    reduced in fp32 (docs/cost-model.md cites where). Written from DeepSpeed's source: the totals are
    compared with measured peaks in benchmarks/plan_memory.py (docs/memory.md)."""
    from training.core.engine import bucket_elements

    plan = P.make_plan(args_for(*SMALL, *flags), world, device_type=device)
    for r in plan["ranks"]:
        n, dp = r["params"], plan["layout"]["data_parallel"]
        by_layer = plan["stages"][r["pp"]]["params_by_layer"]
        largest = max((v for k, v in by_layer.items() if k.startswith(("encoder.", "decoder."))), default=0)
        during, after = want(n, min(bucket_elements(n, 4), n), -(-n // dp), largest)
        assert r["buffers"] == {"during_backward": during, "after_backward": after}, (r["rank"], r["buffers"])


BIG_ACTIVATIONS = [
    "--recipe",
    str(RECIPES / "2pcs" / "2pcs.json"),
    "--batch_size",
    4096,
    "--src_len",
    64,
    "--tgt_len",
    64,
]


def test_a_stage_that_does_not_fit_is_said_with_changes_that_do_fit():
    """The verdict per stage against the device (80% usable): the seed's 2pcs fits an H100 by far; with 4096 pairs of
    64 tokens per step its activations alone are ~24 GiB per GPU: on a 2 GiB device the stage does not fit, and every
    change named would make it fit — re-planned here with its flags, each one fits."""
    plan = P.make_plan(args_for("--recipe", str(RECIPES / "2pcs" / "2pcs.json")), 2)
    assert [v["fits"] for v in plan["memory"]["stages"]] == [True] and plan["memory"]["remedies"] == []
    assert "stage 0: peak " in format_plan(plan) and "→ fits" in format_plan(plan)

    plan = P.make_plan(args_for(*BIG_ACTIVATIONS), 2, device_memory=2)
    (verdict,) = plan["memory"]["stages"]
    assert not verdict["fits"] and verdict["usable_bytes"] == int(0.8 * 2 * 2**30)
    assert verdict["peak_bytes"] == plan["ranks"][0]["total_bytes"] > plan["stages"][0]["activations"]["peak"] > 2**32
    remedies = plan["memory"]["remedies"]
    assert remedies[0].startswith("--micro_batch_num 32 ")  # recompute alone is not enough here
    assert "--recompute 1 --micro_batch_num 32" not in " ".join(remedies)  # not when the smaller change fits
    text = format_plan(plan)
    assert "stage 0: peak " in text and "DOES NOT FIT" in text and "it would fit with: --micro_batch_num 32" in text
    for change in plan["memory"]["remedy_changes"]:
        fixed = P.make_plan(args_for(*BIG_ACTIVATIONS, *change["flags"].split()), change["world_size"], device_memory=2)
        assert all(v["fits"] for v in fixed["memory"]["stages"]), change
    # nothing helps a model bigger than the device: said, not silently
    plan = P.make_plan(args_for(*BIG_ACTIVATIONS), 2, device_memory=0.01)
    assert plan["memory"]["remedies"] == [] and "no change tried fits" in format_plan(plan)


def test_device_names_and_sizes():
    plan = P.make_plan(args_for("--recipe", str(RECIPES / "2pcs" / "2pcs.json")), 2, device="a100-40gb")
    assert plan["memory"]["device"].startswith("a100-40gb 40 GiB") and plan["memory"]["device_bytes"] == 40 * 2**30
    with pytest.raises(UserError, match="--device b200: unknown; known: h100, h200"):
        P.main(["--recipe", R16, "--world_size", "16", "--device", "b200"])
    with pytest.raises(UserError, match="--device_memory 0 must be > 0"):
        P.main(["--recipe", R16, "--world_size", "16", "--device_memory", "0"])


def test_the_per_gpu_batch_at_another_world_size_is_said():
    """The global batch is fixed, so planning 16pcs for 32 ranks halves each GPU's micro-batch: the report says so
    and names the --batch_size that keeps it."""
    text = format_plan(plan_for(32, "--recipe", R16))
    assert "global 32 = micro 8 per GPU × micro_batch_num 2 × dp 2" in text
    assert "16 at dp 1 (16 ranks), 8 here; --batch_size 64 keeps 16 per GPU" in text
    assert "keeps" not in format_plan(plan_for(16, "--recipe", R16))  # dp 1: nothing to say


def test_check_makes_the_checks_train_makes(tmp_path, multi30k_tsv):
    """plan.py --check (the launch scripts' pre-flight) refuses what train.py refuses before it starts, with the
    same line: a ZeRO stage set in the recipe's deepspeed section, token batches whose batch_multiple the layout does
    not divide (--check used to check the unused --batch_size and pass both)."""
    from tests.launch import run_train

    zero_in_ds = write(tmp_path, {"model": SEED_MODEL, "deepspeed": {"zero_optimization": {"stage": 2}}}, "z.json")
    cases = [
        ["--recipe", zero_in_ds],
        ["--recipe", R16, "--max_tokens", 256, "--batch_multiple", 5, "--mp", 1, "--pipeline_stage", 1],
    ]
    for i, flags in enumerate(cases):
        with pytest.raises(UserError) as planned:
            P.main(["--check", "--world_size", "1", *map(str, flags)])
        proc = run_train(1, ["--file_path", multi30k_tsv, "--output_dir", tmp_path / f"t{i}", *flags], check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert errors == [f"error: {planned.value}"], (proc.stderr[-2000:], str(planned.value))
