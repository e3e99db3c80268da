"""plan.py's advice (training/plan/advice.py): uneven pipeline stages with re-planned remedies, remedies that say when
they need more GPUs, the ZeRO label equal to the DeepSpeed config printed, and the small-batch note."""

import json

import pytest

from common.errors import UserError
from model.config import ParallelConfig
from model.costs import deepspeed_zero_stage
from tests.test_plan import R16, RECIPES, args_for, plan_for, run_plan
from training.plan import advice
from training.plan import planner as P
from training.plan.report import format_plan

BIG = RECIPES / "transformer-big-wmt14-en-fr"


def stage_ratios(plan: dict) -> dict:
    """The three ratios of a plan, from its own stage rows (not from the advice)."""
    params = [st["params_per_rank"] for st in plan["stages"]]
    peaks = [st["peak_bytes"] for st in plan["stages"]]
    return {"params": max(params) / min(params), "peak_bytes": max(peaks) / min(peaks)}


def test_16pcs_uneven_stages_flagged_with_replanned_remedies_on_the_same_gpus():
    """The seed's 16pcs: stage 0 holds the replicated word tables (2 × 20000 × 128) — 15× stage 1's parameters.
    Flagged in one line naming the cause; --vocab_emb_dp 0's ratios are those of the plan with that flag, and the
    best split ("move decoder.0 to stage 0") gives, planned through a real pipeline_func, the ratios advertised."""
    plan = plan_for(16, "--recipe", R16)
    bal = plan["advice"]["balance"]
    assert bal["flagged"] and bal["threshold"] == 1.5
    assert bal["ratios"]["params"]["ratio"] == pytest.approx(5_135_936 / 342_000)
    assert (bal["ratios"]["params"]["high_stage"], bal["ratios"]["params"]["low_stage"]) == (0, 1)
    # two word tables and the positions (src_len + tgt_len = 20 rows) replicated on each of the 8 TP ranks
    assert bal["cause"] == {"embeddings_params": 2 * 20000 * 128 + 20 * 128, "stage_params": 5_135_936}
    text = format_plan(plan)
    line = next(x for x in text.splitlines() if x.startswith("  balance"))
    assert "parameters stage 0 15.0× stage 1" in line and "replicated on every TP rank (vocab_emb_dp)" in line
    assert "remedies on the same 16 GPUs" in text

    by = {r["change"]: r for r in bal["remedies"]}
    assert set(by) == {"--vocab_emb_dp 0", "move decoder.0 to stage 0", "--vocab_emb_dp 0 + move decoder.0 to stage 0"}
    assert all(r["world_size"] == 16 and not r["changes_gpu_count"] for r in bal["remedies"])
    split = plan_for(16, "--recipe", R16, "--vocab_emb_dp", 0)
    assert by["--vocab_emb_dp 0"]["ratios"]["params"] == pytest.approx(stage_ratios(split)["params"])
    assert by["--vocab_emb_dp 0"]["ratios"]["peak_bytes"] == pytest.approx(stage_ratios(split)["peak_bytes"])
    assert by["--vocab_emb_dp 0"]["ratios"]["params"] < 2  # 0.66 M against 0.34 M
    assert by["move decoder.0 to stage 0"]["flags"] is None  # no built-in gives that split
    moved = plan_for(16, "--recipe", R16, "--pipeline_func", "tests.pipeline_funcs:every_block_on_stage_0")
    assert [b["stage"] for b in moved["blocks"]] == by["move decoder.0 to stage 0"]["block_stages"] == [0, 0]
    assert by["move decoder.0 to stage 0"]["ratios"]["params"] == pytest.approx(stage_ratios(moved)["params"])
    # re-planned, the remedy's own plan is judged the same way
    assert moved["advice"]["balance"]["ratios"]["flops"]["ratio"] == pytest.approx(
        by["move decoder.0 to stage 0"]["ratios"]["flops"]
    )


def test_a_builtin_split_that_balances_better_is_named_by_its_flag():
    """3 encoder + 2 decoder blocks on 2 stages: the seed's split puts 2 blocks on stage 0, 3 (and the head) on
    stage 1; `--pipeline_func even` balances better — named as that flag, with the ratios of that plan."""
    flags = ("--recipe", R16, "--encoder_layer", 3, "--decoder_layer", 2, "--vocab_emb_dp", 0, "--vocab_size", 1000)
    plan = plan_for(16, *flags)
    (remedy,) = plan["advice"]["balance"]["remedies"]
    assert remedy["flags"] == remedy["change"] == "--pipeline_func even"
    even = plan_for(16, *flags, "--pipeline_func", "even")
    assert remedy["ratios"]["params"] == pytest.approx(stage_ratios(even)["params"])
    worst = max(v["ratio"] for v in plan["advice"]["balance"]["ratios"].values())
    assert max(remedy["ratios"].values()) < worst


def test_no_balance_flag_without_a_pipeline_or_when_even():
    assert plan_for(2, "--recipe", RECIPES / "2pcs" / "2pcs.json")["advice"]["balance"] is None
    even = plan_for(
        2,
        "--recipe",
        R16,
        "--mp",
        1,
        "--vocab_size",
        8,
        "--encoder_layer",
        2,
        "--decoder_layer",
        2,
        "--d_model",
        256,
        "--ffn_size",
        256,
        "--num_heads",
        8,
        "--batch_size",
        1024,
    )
    bal = even["advice"]["balance"]
    assert bal["flagged"] is (max(v["ratio"] for v in bal["ratios"].values()) > 1.5)
    if not bal["flagged"]:
        assert "UNEVEN" not in format_plan(even)


def test_best_split_search_and_its_dynamic_programme_agree():
    """The exhaustive search (small cases) and the min-max programme (large ones), on hand-checkable weights: layer 0
    is the embeddings (stage 0), the last the head (last stage), the blocks between may move."""
    assert advice._minmax_split([0, 1, 1, 1, 1, 0], 2) == [0, 0, 1, 1]
    assert advice._minmax_split([2, 1, 1, 1, 1, 0], 2) == [0, 1, 1, 1]  # heavy embeddings: fewer blocks there
    assert advice._minmax_split([0, 1, 1, 1, 1, 1, 1, 0], 3) == [0, 0, 1, 1, 2, 2]
    # 3 blocks on 3 stages: every non-decreasing split whose middle stage holds a block
    assert sorted(advice._splits(3, 3)) == [[0, 0, 1], [0, 1, 1], [0, 1, 2], [1, 1, 1], [1, 1, 2], [1, 2, 2]]
    rng = __import__("random").Random(0)
    for _ in range(50):
        n, pp = rng.randint(2, 7), rng.randint(2, 4)
        w = [rng.random() for _ in range(n + 2)]

        def heaviest(split, w=w, pp=pp):
            full = [0] + split + [pp - 1]
            return max(sum(x for x, k in zip(w, full, strict=True) if k == s) for s in range(pp))

        if pp - 2 > n:
            continue
        assert heaviest(advice._minmax_split(w, pp)) == pytest.approx(min(map(heaviest, advice._splits(n, pp))))


def test_memory_remedies_say_when_they_need_more_gpus():
    """transformer-big on one 6 GiB GPU (batch 8): twice the pipeline stages fits, on 2 GPUs — said as such
    ("needs 2 GPUs, not 1"), and --json says which remedies change the GPU count; each fits re-planned at its world."""
    flags = ("--recipe", BIG / "transformer-big-wmt14-en-fr.json", "--batch_size", 8)
    plan = P.make_plan(args_for(*flags), 1, device_memory=6)
    changes = plan["memory"]["remedy_changes"]
    pp = next(c for c in changes if c["flags"] == "--pipeline_stage 2")
    assert pp["world_size"] == 2 and pp["changes_gpu_count"]
    assert "--pipeline_stage 2 (needs 2 GPUs, not 1: --world_size 2;" in format_plan(plan)
    assert all(c["changes_gpu_count"] == (c["world_size"] != 1) for c in changes)
    assert plan["memory"]["remedies"] == [c["text"] for c in changes]
    for c in changes:
        fixed = P.make_plan(args_for(*flags, *c["flags"].split()), c["world_size"], device_memory=6)
        assert all(v["fits"] for v in fixed["memory"]["stages"]), c


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_zero_rule_of_plan_and_check_is_the_engines(precision, zero):
    from training.core.engine import optimizer_zero_stage

    parallel = ParallelConfig(data_parallel=2, zero_stage=zero)
    assert deepspeed_zero_stage(zero, precision) == optimizer_zero_stage(parallel, precision)


def test_the_zero_label_is_the_deepspeed_configs():
    """transformer-big on one GPU asks ZeRO 0 in bf16, and DeepSpeed runs stage 1 (fp32 master weights): the layout
    line, --check and --json say 1, as the DeepSpeed config printed below them does (they said 0)."""
    recipe = BIG / "transformer-big-wmt14-en-fr.json"
    plan = plan_for(1, "--recipe", recipe, "--batch_size", 96)
    L = plan["layout"]
    assert L["zero_stage"] == plan["deepspeed"]["zero_optimization"]["stage"] == 1 and L["zero_stage_requested"] == 0
    text = format_plan(plan)
    layout = next(x for x in text.splitlines() if x.startswith("  layout"))
    assert "ZeRO 1 (optimizer state sharded over dp; ZeRO 0 asked, DeepSpeed runs 1 in bf16" in layout
    assert '"stage": 1' in text.split("DeepSpeed config (rank 0)")[1]
    assert "; ZeRO 1; " in P.check_line(args_for("--recipe", recipe), 1)
    fp32 = plan_for(16, "--recipe", R16, "--zero_stage", 0)
    assert fp32["layout"]["zero_stage"] == fp32["deepspeed"]["zero_optimization"]["stage"] == 0
    assert "ZeRO 0 (off)" in format_plan(fp32)


def test_a_tiny_batch_for_the_gpus_is_noted_with_its_threshold():
    """16pcs: 16 pairs of 10 tokens per GPU per micro-batch, far below 132 SMs × 128 × 128 / d_model 128 = 16,896
    rows; transformer-big's 96 × 256 per GPU is above its 2,112 and gets no note."""
    plan = plan_for(16, "--recipe", R16)
    sb = plan["advice"]["small_batch"]
    assert sb["tokens_per_micro_batch"] == 160 and sb["threshold_tokens"] == 132 * 128 * 128 // 128
    assert sb["batch_size_at_threshold"] == 1690 * 2 * 1  # ⌈16896 / 10⌉ pairs × mb 2 × dp 1
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("  small batch"))
    assert "160 source tokens per GPU per micro-batch" in line and "below 16,896 = 132 SMs × 128 × 128" in line
    assert "--batch_size 3380 reaches it" in line
    assert plan_for(16, "--recipe", R16, "--batch_size", 3380)["advice"]["small_batch"] is None
    big = plan_for(8, "--recipe", BIG / "transformer-big-wmt14-en-fr-8gpu.json", "--batch_size", 768)
    assert big["advice"]["small_batch"] is None
    a100 = P.make_plan(args_for("--recipe", R16), 16, device="a100")
    assert a100["advice"]["small_batch"]["threshold_tokens"] == 108 * 128


def test_json_carries_the_advice():
    proc = run_plan("--recipe", R16, "--world_size", 16, "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    bal = plan["advice"]["balance"]
    assert bal["flagged"] and [r["change"] for r in bal["remedies"]][0] == "--vocab_emb_dp 0"
    assert plan["advice"]["small_batch"]["threshold_tokens"] == 16896
    assert plan["memory"]["remedy_changes"] == []


def test_a_layout_that_cannot_run_stays_one_error():
    with pytest.raises(UserError, match="but the world has 8 processes"):
        P.main(["--recipe", R16, "--world_size", "8"])
