"""Gradients are averaged over the data-parallel ranks in fp32 under every half-precision layout, while the weights
stay half — checked on the collectives DeepSpeed really issues.

Each case is train.py's own run (tests/drivers/train_many.py --trace_collectives, one launch per world size, 2 steps
of 2 micro-batches, the TINY model, real processes on gloo) under tests/collective_trace.CollectiveTrace, which
records every collective at the dispatcher (op, dtype, element count, group), whatever path DeepSpeed took to it.
Per rank, the gradient reductions are the all-reduces / reduces / reduce-scatters over its data-parallel group
(plus, with shared embeddings on a pipeline, the tied table's gradient sum between the first and last stage):

- none is in bf16 or fp16;
- they are not vacuous: the bytes they put on the wire per step (ring volumes: an all-reduce sends 2·(dp-1)/dp of
  its fp32 size, a reduce-scatter (dp-1)/dp) are plan.py's data-parallel gradient bytes for the layout, within 1%
  (the norms and the alignment padding are the rest) — so every gradient element is reduced, in fp32, each step;
- the updated weights DeepSpeed all-gathers over the same group are in the training precision (weights stay half).

Without `communication_data_type` fp32 in training.core.engine.deepspeed_config every data-parallel case fails the
first check (DeepSpeed then reduces in the training precision: a bf16 all-reduce of all gradients after backward
under BF16_Optimizer, bf16 bucket all-reduces under ZeRO 2, a bf16 reduce-scatter under ZeRO 3); the tied sum is
fp32 either way (DeepSpeed sums BF16_Optimizer's fp32 copy).
"""

import json

import pytest

from tests import accelerator
from tests.collective_trace import HALF, REDUCTIONS
from tests.launch import TINY, run_many

STEPS = 2
MB2 = ["--micro_batch_num", "2"]
PP2 = ["--pipeline_stage", "2", *MB2]
CASES = [
    # name                    procs precision flags                                   optimizer DeepSpeed builds
    ("bf16-dp2-zero0", 2, "bf16", MB2, "BF16_Optimizer"),
    ("bf16-dp2-zero1", 2, "bf16", MB2 + ["--zero_stage", "1"], "BF16_Optimizer"),
    ("bf16-dp2-zero2", 2, "bf16", MB2 + ["--zero_stage", "2"], "DeepSpeedZeroOptimizer"),
    ("bf16-dp2-zero3", 2, "bf16", MB2 + ["--zero_stage", "3"], "DeepSpeedZeroOptimizer_Stage3"),
    ("fp16-dp2-zero0", 2, "fp16", MB2, "DeepSpeedZeroOptimizer"),
    ("fp16-dp2-zero2", 2, "fp16", MB2 + ["--zero_stage", "2"], "DeepSpeedZeroOptimizer"),
    # the pipeline engine's own reduction after the last micro-batch, and the shared table's sum between stages
    ("bf16-dp2xpp2-share", 4, "bf16", PP2 + ["--share_embeddings", "1"], "BF16_Optimizer"),
    ("fp16-dp2xpp2-zero1", 4, "fp16", PP2 + ["--zero_stage", "1"], "DeepSpeedZeroOptimizer"),
]
BY_NAME = {c[0]: c for c in CASES}
RUNNABLE = {name for name, _, precision, _, _ in CASES if accelerator.supported(precision)}


@pytest.fixture(scope="module")
def traced(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    """Output folder of each case; every runnable case of a world size in one launch, on demand."""
    root = tmp_path_factory.mktemp("grad_reduce")
    done: dict = {}

    def get(name):
        if name not in done:
            nproc = BY_NAME[name][1]
            batch = [
                (
                    n,
                    [
                        "--file_path",
                        multi30k_tsv,
                        "--tokenizer",
                        bpe_tokenizer,
                        "--steps",
                        STEPS,
                        "--output_dir",
                        root / n,
                        *TINY,
                        "--precision",
                        precision,
                        "--clip_grad",
                        "0.5",
                        *flags,
                    ],
                )
                for n, procs, precision, flags, _ in CASES
                if procs == nproc and n in RUNNABLE
            ]
            run_many(nproc, [argv for _, argv in batch], root, "--trace_collectives")
            done.update({n: root / n for n, _ in batch})
        return done[name]

    return get


def planned(name, bpe_tokenizer) -> dict:
    """plan.py for the case's flags and world: every rank's coordinates, parameters and data-parallel bytes."""
    from training.config.flags import parse_args
    from training.config.sections import TrainConfig
    from training.plan import planner as P

    _, nproc, precision, flags, _ = BY_NAME[name]
    argv = ["--tokenizer", bpe_tokenizer, *TINY, "--precision", precision, *flags, "--vocab_size", "8000"]
    return P.make_plan(
        TrainConfig.from_flags(parse_args([str(a) for a in argv], parser=P.build_plan_parser())),
        nproc,
        device_type="cpu",
    )


def groups_of(plan: dict, rank: int) -> tuple[list[int], list[int]]:
    """(the rank's data-parallel group, its tied-embedding group or []), as global ranks."""
    me = plan["ranks"][rank]
    last = plan["layout"]["pipeline_stage"] - 1
    dp_group = sorted(r["rank"] for r in plan["ranks"] if (r["pp"], r["tp"]) == (me["pp"], me["tp"]))
    tied = (
        sorted(r["rank"] for r in plan["ranks"] if (r["dp"], r["tp"]) == (me["dp"], me["tp"]) and r["pp"] in (0, last))
        if last > 0 and me["pp"] in (0, last)
        else []
    )
    return dp_group, tied


def wire_bytes(record: dict, group_size: int) -> float:
    """What one rank sends for a reduction in a ring: all-reduce 2·(n-1)/n of the tensor, reduce-scatter and
    reduce (n-1)/n."""
    size = record["numel"] * {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}.get(record["dtype"], 4)
    share = (group_size - 1) / group_size
    return (2 if record["op"].startswith("allreduce") else 1) * share * size


@pytest.mark.slow
@pytest.mark.parametrize("name", [accelerator.param(c[0], c[2]) for c in CASES])
def test_every_data_parallel_gradient_reduction_is_fp32(name, traced, bpe_tokenizer):
    out = traced(name)
    _, nproc, precision, flags, optimizer = BY_NAME[name]
    info = json.loads((out / "run.json").read_text())
    plan = planned(name, bpe_tokenizer)
    assert plan["ranks"][0]["params"] == info["params_rank0"]  # plan and run count the same model
    half = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    for rank in range(nproc):
        records = json.loads((out / f"collectives-rank{rank}.json").read_text())
        dp_group, tied = groups_of(plan, rank)
        grads = [r for r in records if r["op"] in REDUCTIONS and r["ranks"] in (dp_group, tied)]
        in_half = [r for r in grads if r["dtype"] in HALF]
        assert not in_half, f"rank {rank}: {len(in_half)} gradient reductions in half precision, e.g. {in_half[:3]}"
        on_dp = [r for r in grads if r["ranks"] == dp_group]
        sent = sum(wire_bytes(r, len(dp_group)) for r in on_dp) / STEPS
        want = plan["stages"][plan["ranks"][rank]["pp"]]["dp"]["grad_bytes_per_step"]
        print(
            f"GRAD_REDUCE {name} rank {rank}: {len(on_dp)} reductions over dp {dp_group}, "
            f"{sorted({r['dtype'] for r in on_dp})}, {sent:,.0f} B sent per step (plan.py: {want:,} B)"
            + (f"; tied sum over {tied}: {sorted({r['dtype'] for r in grads if r['ranks'] == tied})}" if tied else "")
        )
        assert want > 0 and abs(sent / want - 1) <= 0.01, (sent, want, on_dp)
        if tied:
            assert any(r["ranks"] == tied and r["numel"] >= 8000 * 32 for r in grads), "no tied-table sum traced"
        gathers = [r for r in records if "allgather" in r["op"] and r["ranks"] == dp_group and r["numel"] > 1000]
        assert gathers and all(r["dtype"] == half for r in gathers), gathers[:3]  # the weights stay half
    # what run.json says about it (engine.describe)
    assert (info["optimizer"], info["precision"], info["grad_reduce_dtype"]) == (optimizer, precision, "float32")
