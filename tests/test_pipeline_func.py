"""pipeline_func as the seed uses it: the default split is MindSpore's, `even` stays available by name, the object
a function receives supports `pipeline_stage`, `recompute()` (per block, exact) and `set_comm_fusion()` (reported by
plan.py), and a function that misbehaves gives one `error:` line. The pipelined run of the tutorial's own lambda
against the serial loss is a case of tests/test_parity.py ("pp2-seed-lambda-recompute")."""

import sys

import pytest
import torch

from model.config import ConfigError, ModelConfig, ParallelConfig
from model.parallel.random import RNG
from model.placement import assign_stages, load_pipeline_func, place_blocks
from model.transformer import DecoderLayer, EncoderLayer, Seq2SeqTransformer
from tests import pipeline_funcs
from tests.launch import env, run_python
from tests.test_plan import R16, REPO, plan_for
from tests.test_tp_model import batch, tiny


def blocks(e, d):
    return ModelConfig(encoder_layers=e, decoder_layers=d)


def seed_formula(i, layers, pp):
    """MindSpore's default layer lambda, as the issue quotes it."""
    return min(i // max(layers // pp, 1), pp - 1)


def test_default_split_is_the_seeds_up_to_8x8x8():
    checked = 0
    for e in range(1, 9):
        for d in range(1, 9):
            for pp in range(1, 9):
                if pp > e + d:
                    continue
                want = [seed_formula(i, e + d, pp) for i in range(e + d)]
                assert assign_stages(blocks(e, d), ParallelConfig(pipeline_stage=pp)) == want, (e, d, pp)
                checked += 1
    assert checked == 8 * 8 * 8 - 56  # all but the 56 with more stages than blocks (validate_layout refuses)


def test_seed_and_even_differ_where_the_issue_says():
    m, par = blocks(2, 2), ParallelConfig(pipeline_stage=3)
    assert assign_stages(m, par) == [0, 1, 2, 2]  # the seed's: remainder on the last
    assert assign_stages(m, par, load_pipeline_func("seed")) == [0, 1, 2, 2]
    assert assign_stages(m, par, load_pipeline_func("even")) == [0, 0, 1, 2]


def test_builtins_set_fusion_ids_and_recompute_like_the_seeds_default():
    m = blocks(4, 4)
    for name in ("seed", "even"):
        placed = place_blocks(
            m, ParallelConfig(pipeline_stage=2, gradient_aggregation_group=4, recompute=True), load_pipeline_func(name)
        )
        assert [p.comm_fusion for p in placed] == [1, 1, 2, 2, 3, 3, 4, 4]  # 8 // 4 = 2 blocks per id
        assert all(p.recomputed for p in placed)
        assert not any(
            p.recomputed for p in place_blocks(m, ParallelConfig(pipeline_stage=2), load_pipeline_func(name))
        )


def test_tutorial_lambda_runs_as_written():
    placed = place_blocks(blocks(2, 2), ParallelConfig(pipeline_stage=2, recompute=True), pipeline_funcs.seed_tutorial)
    assert [p.pipeline_stage for p in placed] == [1, 1, 1, 1]  # max(i / 3, 1): every block after the embeddings
    assert [p.comm_fusion for p in placed] == [1, 2, 3, 4]
    assert [p.recomputed for p in placed] == [True, False, True, False]
    # one stage: no pipeline, the stage it asks for (1) is not used; recompute and fusion ids still are
    placed = place_blocks(blocks(2, 2), ParallelConfig(recompute=True), pipeline_funcs.seed_tutorial)
    assert [p.pipeline_stage for p in placed] == [0, 0, 0, 0]
    assert [p.recomputed for p in placed] == [True, False, True, False]


def _loss_grads_and_replays(pipeline_func):
    """Serial model with dropout: loss, gradients and how often each block's forward ran in one step."""
    cfg = tiny(dropout=0.2)
    model = Seq2SeqTransformer(cfg, ParallelConfig(recompute=True), seed=3, pipeline_func=pipeline_func).train()
    RNG.seed(11)
    runs = {}
    for i, blk in enumerate(model.blocks):
        if isinstance(blk, (EncoderLayer, DecoderLayer)):
            inner = blk._forward
            blk._forward = lambda *a, i=i, f=inner: (runs.__setitem__(i, runs.get(i, 0) + 1), f(*a))[1]
    src, tgt, labels = batch(cfg.vocab_size)
    loss = model.loss_sum(src, tgt, labels)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, runs


def test_recompute_only_the_blocks_it_is_called_on_and_exactly():
    """encoder_only_recompute: blocks 1-2 (encoder) run their forward twice, 3-4 (decoder) once, and the loss and
    every gradient equal the run without recompute bit for bit (dropout on: the masks are replayed)."""
    l0, g0, runs0 = _loss_grads_and_replays(pipeline_funcs.encoder_only_recompute)
    assert runs0 == {1: 2, 2: 2, 3: 1, 4: 1}
    l1, g1, runs1 = _loss_grads_and_replays(lambda net, *a: None)  # recomputes nothing
    assert runs1 == {1: 1, 2: 1, 3: 1, 4: 1}
    assert l0 == l1
    for name in g1:
        assert torch.equal(g0[name], g1[name]), name


def test_pipelined_stage_modules_carry_the_functions_recompute():
    """The blocks a pipeline rank builds (block_specs, as build_pipeline_module) recompute as the function said."""
    from training.plan.stage_build import build_stage_modules

    m = tiny(enc=2, dec=2)
    par = ParallelConfig(pipeline_stage=2, recompute=True)
    mods = [mod for stage in (0, 1) for _, mod in build_stage_modules(m, par, stage, 0, pipeline_funcs.seed_tutorial)]
    flags = [mod.recompute for mod in mods if isinstance(mod, (EncoderLayer, DecoderLayer))]
    assert flags == [True, False, True, False]


@pytest.mark.parametrize(
    "func,needles",
    [
        (
            "out_of_range",
            [
                "pipeline_func tests.pipeline_funcs:out_of_range placed blocks",
                "on stages [1, 2, 3, 4] with pipeline_stage=2",
                "every stage must be in 0..1 (encoder.1 is on 2)",
            ],
        ),
        ("decreasing", ["on stages [1, 0, 1, 0]", "must not decrease", "(encoder.1 on 0 after encoder.0 on 1)"]),
        ("skips_a_stage", ["on stages [0, 0, 2, 2] with pipeline_stage=3", "stage(s) [1] hold no block"]),
        ("float_stage", ["set pipeline_stage=0.0 (float)", "block encoder.0", "must be an int"]),
        (
            "raises_on_decoder",
            [
                "pipeline_func tests.pipeline_funcs:raises_on_decoder raised KeyError",
                "no stage table entry",
                "block decoder.0 (layer_id=0, offset=2, layers=4)",
            ],
        ),
    ],
)
def test_bad_pipeline_func_is_named(func, needles):
    par = ParallelConfig(pipeline_stage=3 if func == "skips_a_stage" else 2)
    with pytest.raises(ConfigError) as err:
        place_blocks(blocks(2, 2), par, load_pipeline_func(f"tests.pipeline_funcs:{func}"))
    for needle in needles:
        assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_raising_pipeline_func_is_one_error_line_from_the_cli(assert_user_error):
    proc = run_python(
        [
            sys.executable,
            "run_scripts/plan.py",
            "--recipe",
            R16,
            "--world_size",
            "16",
            "--check",
            "--pipeline_func",
            "tests.pipeline_funcs:raises_on_decoder",
        ],
        cwd=REPO,
        env=env(),
        timeout=120,
    )
    assert_user_error(proc, "raises_on_decoder raised KeyError", "block decoder.0")


def test_unknown_builtin_is_named():
    with pytest.raises(ConfigError, match="neither a built-in \\(seed, even\\)"):
        load_pipeline_func("uneven")


def test_plan_prints_the_split_and_each_blocks_stage():
    """plan.py names the function and lists stage, recompute and fusion id of every block."""
    flags = [
        "--recipe",
        R16,
        "--encoder_layer",
        "2",
        "--decoder_layer",
        "2",
        "--pipeline_stage",
        "3",
        "--mp",
        "1",
        "--micro_batch_num",
        "3",
        "--batch_size",
        "12",
    ]
    from training.plan.report import format_plan

    for name, stages in (("seed", [0, 1, 2, 2]), ("even", [0, 0, 1, 2])):
        plan = plan_for(3, *flags, "--pipeline_func", name)
        assert plan["layout"]["pipeline_func"] == name
        assert [b["stage"] for b in plan["blocks"]] == stages
        assert [b["block"] for b in plan["blocks"]] == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
        text = format_plan(plan)
        assert f"pipeline_func: {name}" in text
        for b, s in zip(plan["blocks"], stages):
            assert any(line.split()[:2] == [b["block"], str(s)] for line in text.splitlines()), text
    plan = plan_for(3, *flags, "--pipeline_func", "tests.pipeline_funcs:seed_tutorial", "--recompute", "1")
    assert plan["layout"]["pipeline_func"] == "tests.pipeline_funcs:seed_tutorial"
    assert [(b["stage"], b["recompute"], b["comm_fusion"]) for b in plan["blocks"]] == [
        (1, True, 1),
        (1, False, 2),
        (1, True, 3),
        (1, False, 4),
    ]
    assert plan_for(3, *flags)["layout"]["pipeline_func"] == "seed"  # the default


def test_plan_counts_only_the_recomputed_blocks():
    """Recomputing half the blocks costs between none and all of them, in activations and repeated all-reduces."""
    base = [
        "--recipe",
        R16,
        "--encoder_layer",
        "2",
        "--decoder_layer",
        "2",
        "--pipeline_stage",
        "1",
        "--micro_batch_num",
        "1",
        "--mp",
        "2",
        "--batch_size",
        "4",
    ]

    def stage0(*extra):
        st = plan_for(2, *base, *extra)["stages"][0]
        return st["activations"]["per_micro_batch"], len(st["tp_allreduce"]["backward_elements"])

    none = stage0()
    half = stage0("--recompute", "1", "--pipeline_func", "tests.pipeline_funcs:seed_tutorial")
    every = stage0("--recompute", "1")
    assert every[0] < half[0] < none[0]
    assert none[1] < half[1] < every[1]
    assert half[1] - none[1] == 2 + 3  # encoder.0 (2 forward all-reduces) + decoder.0 (3)
