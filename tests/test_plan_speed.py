"""plan.py --predict_speed (training/plan/speed_prediction.py): the arithmetic on a hand-checkable case, the
transformer-big recipes' 1/8/16-GPU predictions, and bad inputs refused in one line."""

import json

import pytest

from common.errors import UserError
from tests.test_plan import RECIPES, run_plan
from training.plan import speed_prediction as S

BIG = RECIPES / "transformer-big-wmt14-en-fr"
NO_COMM = {
    "tp_bytes": 0,
    "tp_spans": False,
    "pp_bytes": 0,
    "pp_spans": False,
    "dp_grad_bytes": 0,
    "dp_param_bytes": 0,
    "dp_spans": False,
    "dp_overlap_share": 0.0,
}


def test_prediction_by_hand():
    """16 GPUs, 2 nodes of 8, pure data parallel: 1 GB of gradients and 0.5 GB of parameters sent per rank, across
    nodes at 800 Gb/s a node = 12.5 GB/s a GPU: 80 + 40 ms after a 1 s compute → 1.12 s, speed-up 16 / 1.12."""
    links = S.Links(intra_node_gb_s=100, inter_node_gb_s=800, gpus_per_node=8)
    comm = {**NO_COMM, "dp_grad_bytes": 1e9, "dp_param_bytes": 0.5e9, "dp_spans": True}
    p = S.predict(1.0, 16, 16, 1, 1, 1, comm, links)
    assert p["dp_gradient_s"] == pytest.approx(0.08) and p["dp_param_gather_s"] == pytest.approx(0.04)
    assert p["step_time_s"] == pytest.approx(1.12)
    assert p["speedup"] == pytest.approx(16 / 1.12) and p["efficiency"] == pytest.approx(1 / 1.12)
    # inside one node the same bytes go at 100 GB/s: 10 + 5 ms
    inside = S.predict(1.0, 8, 8, 1, 1, 1, {**comm, "dp_spans": False}, links)
    assert inside["step_time_s"] == pytest.approx(1.015)
    # tp 2 × pp 2 × dp 2, 2 micro-batches: compute 1 s / 4 = 0.25 s, stretched by (2+2-1)/2 → 0.375 s (bubble 1/3);
    # 0.2 GB of TP sends at 100 GB/s = 2 ms, 0.1 GB pipeline sends = 1 ms; gradients 0.3 s of which half may hide,
    # but at most the last micro-batch's backward, 2/3 × 0.25 / 2 = 0.0833 s
    comm = {**NO_COMM, "tp_bytes": 0.2e9, "pp_bytes": 0.1e9, "dp_grad_bytes": 30e9, "dp_overlap_share": 0.5}
    p = S.predict(1.0, 8, 2, 2, 2, 2, comm, links)
    assert p["pipeline_bubble_share"] == pytest.approx(1 / 3)
    assert p["compute_s"] == pytest.approx(0.25) and p["pipeline_bubble_s"] == pytest.approx(0.125)
    assert p["tp_s"] == pytest.approx(0.002) and p["pp_s"] == pytest.approx(0.001)
    assert p["dp_hidden_s"] == pytest.approx(2 / 3 * 0.125)
    assert p["step_time_s"] == pytest.approx(0.375 + 0.002 + 0.001 + 0.3 - 2 / 3 * 0.125)
    assert p["speedup"] == pytest.approx(2 * 1.0 / p["step_time_s"])
    # one GPU: its own time, efficiency 1
    assert S.predict(0.5, 1, 1, 1, 1, 1, NO_COMM, links)["efficiency"] == 1.0


def test_default_step_time_is_flops_at_the_assumed_mfu():
    assert S.default_step_time(989.4e12 * 0.35, "h100", "bf16") == pytest.approx(1.0)
    assert S.default_step_time(1e12, "a100", "bf16", mfu=0.5) == pytest.approx(1e12 / (0.5 * 312e12))
    with pytest.raises(UserError, match="no peak FLOP/s known for --device l4 .* --step_time_1gpu"):
        S.default_step_time(1e12, "l4", "bf16")


def predicted(recipe: str, world: int, batch: int, *extra) -> dict:
    proc = run_plan(
        "--recipe",
        BIG / recipe,
        "--world_size",
        world,
        "--batch_size",
        batch,
        "--device",
        "h100",
        "--predict_speed",
        "--json",
        *extra,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["speed"]


def test_transformer_big_scaling_prediction():
    """The recipe's three layouts at the same 96 × 256-token batch per GPU: one GPU is its own reference, 8 GPUs
    (one node, NVLink) scale above the seed's "8 cards > 5× one card", 16 GPUs (two nodes, InfiniBand) are slower
    per step than 8 — the all-reduce crosses the network — yet faster in throughput."""
    one = predicted("transformer-big-wmt14-en-fr.json", 1, 96)
    eight = predicted("transformer-big-wmt14-en-fr-8gpu.json", 8, 768)
    sixteen = predicted("transformer-big-wmt14-en-fr-16gpu.json", 16, 1536)
    assert one["efficiency"] == 1.0 and one["step_time_s"] == one["step_time_1gpu_s"]
    assert one["step_time_1gpu_s"] == eight["step_time_1gpu_s"] == sixteen["step_time_1gpu_s"]
    assert one["step_time_1gpu_source"].startswith("assumed, not measured")
    assert 0 < eight["efficiency"] < 1 and eight["speedup"] > 5
    assert not eight["comm"]["dp_spans"] and sixteen["comm"]["dp_spans"]
    assert sixteen["step_time_s"] > 1.2 * eight["step_time_s"]
    assert 0 < sixteen["efficiency"] < eight["efficiency"] and sixteen["speedup"] > eight["speedup"]
    assert not sixteen["comm"]["dp_overlaps_backward"]  # bf16 at ZeRO 1: BF16_Optimizer, after backward
    # a measured one-GPU time replaces the estimate, and is said to be given
    given = predicted("transformer-big-wmt14-en-fr-8gpu.json", 8, 768, "--step_time_1gpu", 0.25)
    assert given["step_time_1gpu_s"] == 0.25 and given["step_time_1gpu_source"] == "given: --step_time_1gpu"
    assert given["efficiency"] > eight["efficiency"]  # a longer step hides the same bytes better


def test_text_section_only_when_asked():
    args = ("--recipe", BIG / "transformer-big-wmt14-en-fr-16gpu.json", "--world_size", 16, "--batch_size", 1536)
    plain = run_plan(*args)
    assert plain.returncode == 0 and "speed (prediction" not in plain.stdout
    text = run_plan(*args, "--predict_speed").stdout
    section = text.split("speed (prediction, not a measurement)")[1]
    assert "assumed, not measured" in section and "across nodes, 50 GB/s per GPU" in section
    assert "scaling efficiency" in section and "NVLink 450 GB/s" in section


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--intra_node_GB_s", "0", "--intra_node_GB_s"),
        ("--inter_node_Gb_s", "-400", "--inter_node_Gb_s"),
        ("--step_time_1gpu", "0", "--step_time_1gpu"),
        ("--assumed_mfu", "1.5", "--assumed_mfu"),
    ],
)
def test_bad_inputs_are_one_error_line(assert_user_error, flag, value, needle):
    proc = run_plan(
        "--recipe", BIG / "transformer-big-wmt14-en-fr-8gpu.json", "--world_size", 8, "--predict_speed", flag, value
    )
    assert proc.returncode == 2
    assert_user_error(proc, needle)


def test_links_refuse_non_positive_bandwidths():
    with pytest.raises(UserError, match="--inter_node_Gb_s 0: a bandwidth or GPU count must be > 0"):
        S.Links(450, 0, 8)
    with pytest.raises(UserError, match="--step_time_1gpu -1: a step time must be > 0"):
        S.predict(-1, 1, 1, 1, 1, 1, NO_COMM, S.Links(450, 3200, 8))


def test_a_step_too_short_for_a_bandwidth_model_is_said():
    """The seed's 16pcs (d_model 128, 32 pairs of 10 tokens) predicts microseconds: the section says such a step is
    bound by launches and latency, which it leaves out, and that its pipeline sends cross the nodes."""
    text = run_plan(
        "--recipe",
        RECIPES / "16pcs" / "16pcs.json",
        "--hostfile",
        RECIPES.parent / "run_scripts" / "hostfiles" / "hostfile_2nodes",
        "--predict_speed",
    ).stdout
    section = text.split("speed (prediction, not a measurement)")[1]
    assert "read these times as lower bounds" in section and "pipeline sends" in section
    assert "(across nodes)" in section and "(33% idle)" in section  # pp 2, 2 micro-batches: 1/3
