"""Every parallel layout trains exactly like one process — in fp32 with gradient clipping, and in bf16 and fp16.

A declarative list of (name, processes, flags), as torchtitan's integration tests. All cases of one world size run
in ONE launch (tests/drivers/train_many.py: the same train.py code, run after run; ranks started as DeepSpeed's
launcher starts them, tests/launch.py), on CPU/gloo, 20 steps each, dropout 0, and are compared with the
single-process run of the same precision:

fp32 (clipped every step at CLIP: the serial run's pre-clip norm is asserted to exceed it at every step)
    loss        step 1 within 1e-6 relative, every step within 1e-5        (measured: ≤ 2.3e-7)
    grad_norm   the logged pre-clip global norm, every step within 1e-5    (measured: ≤ 2e-7)
    weights     after the last step, every merged tensor within RMS 0.01·lr of the serial one. Adam moves an
                element by about lr per step, so a tensor that is not updated, updated twice, or clipped with
                another norm is off by O(lr) per step; fp32 summation order gives ≤ 7e-4·lr (the attention key
                biases, whose true gradient is exactly zero and whose updates are rounding noise).
bf16 / fp16 (same clipping; DeepSpeed's BF16_Optimizer / ZeRO optimizers: fp32 master weights, moments and
gradient accumulation)
    loss        every step within HALF_LOSS_TOL = 5e-4 relative of the same-precision single-process run, and
    grad_norm   within HALF_NORM_TOL = 1e-2. Rounding alone gives: layouts vs the bf16 single-process run
                ≤ 5.1e-5 (loss) and ≤ 1.2e-3 (norm); the bf16 single-process run vs fp32 ≤ 1.3e-4 / 2.3e-3 — a
                layout may round differently, by no more than bf16 itself does. Gradients are averaged over the dp
                ranks in fp32 (on a 2-core avx512_bf16 CPU the layouts' worst went from 4.5e-5 / 1.2e-3 with
                DeepSpeed's bf16 reduction to 3.7e-5 / 9.8e-4): what is left is bf16 compute — bf16-tp2, which has
                no data-parallel reduction, is 2.7e-5 / 9.6e-4 either way — so the bounds stay. Real bugs are
                larger: a micro-batch or data-parallel share dropped or counted twice, a loss normalised by the wrong
                token
                count or a missing tensor-parallel reduction change the loss by 1e-2 to 1 from the first steps;
                the bf16 data-parallel path this repository used to take (DeepSpeed's ZeRO-0 wrapper, bf16
                gradients all-reduced and accumulated in bf16) is off by 3.0e-3 (loss) and 8e-2 (norm). Smaller
                bugs are below bf16's resolution — DeepSpeed's own fp32 clipping under pp2, which left stage 1's
                LayerNorms out of the norm, moved the loss by 3.7e-4 — and the fp32 checks above catch them (that
                one: 3.7e-4 in loss, 0.6·lr RMS in weights, no norm logged). Each half-precision run also
                reports (run.json) the optimizer DeepSpeed built and the dtypes it accumulates and reduces
                gradients in: float32 (every reduction traced: tests/test_grad_reduce_dtype.py).
shared embeddings (--share_embeddings: one table for source, target and output projection; vocab-parallel under
TP, a replica on the pipeline's last stage whose gradient DeepSpeed sums with stage 0's) meet the fp32 bounds
above against a shared-embedding single-process run, and the bf16 ones through BF16_Optimizer.
dropout 0.1 under TP: after the steps, every replicated parameter (LayerNorms, row-parallel biases, embeddings) is
bit-identical on every TP rank. Replicated parameters get no TP reduction, so this fails if the residual or
embedding dropout masks ever differed between the TP ranks of a stage.
"""

import json
import math

import pytest
import torch

from tests import accelerator
from tests.launch import TINY, attempt_dir, merged, read_metrics, run_many

STEPS = 20
CLIP = 0.5
HALF_LOSS_TOL, HALF_NORM_TOL = 5e-4, 1e-2
LR = float(TINY[TINY.index("--lr") + 1])

PP2 = ["--pipeline_stage", "2", "--micro_batch_num", "4"]
# token batches: 8 to 32 pairs of similar length, padded to 8 or 12 (TINY's length) — shapes change every step
MAXTOK = ["--max_tokens", "256", "--batch_multiple", "8"]
FP32 = [
    # name                      procs  flags
    ("dp2", 2, []),
    ("dp2-zero1", 2, ["--enable_parallel_optimizer", "1"]),
    ("dp2-zero2", 2, ["--zero_stage", "2"]),
    ("dp2-zero3", 2, ["--zero_stage", "3"]),
    ("tp2", 2, ["--mp", "2"]),
    ("tp2-recompute", 2, ["--mp", "2", "--recompute", "1"]),
    ("pp2-mb4", 2, PP2),
    ("pp2-mb4-recompute", 2, PP2 + ["--recompute", "1"]),
    # the seed tutorial's own lambda: every block on stage 1, recompute() on every other block, fusion ids
    (
        "pp2-seed-lambda-recompute",
        2,
        PP2 + ["--recompute", "1", "--pipeline_func", "tests.pipeline_funcs:seed_tutorial"],
    ),
    ("dp2xtp2", 4, ["--mp", "2"]),
    ("dp2xpp2-zero1", 4, ["--pipeline_stage", "2", "--micro_batch_num", "2", "--enable_parallel_optimizer", "1"]),
    ("tp2xpp2-mb2", 4, ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2"]),
    (
        "dp2xtp2xpp2-zero1-recompute",
        8,
        [
            "--mp",
            "2",
            "--pipeline_stage",
            "2",
            "--micro_batch_num",
            "2",
            "--enable_parallel_optimizer",
            "1",
            "--recompute",
            "1",
        ],
    ),
    # ZeRO-1 at dp 4: also what plan.py's optimizer-state bytes are checked against
    ("dp4-zero1", 4, ["--enable_parallel_optimizer", "1"]),
]
TOKEN_BATCHES = [  # --max_tokens against a single-process run with the same token batches
    ("maxtok-dp2-zero1", 2, MAXTOK + ["--enable_parallel_optimizer", "1"]),
    ("maxtok-tp2", 2, MAXTOK + ["--mp", "2"]),
    ("maxtok-pp2-mb2", 2, MAXTOK + ["--pipeline_stage", "2", "--micro_batch_num", "2"]),
    # stage boundaries split over the TP ranks (pipe_partitioned) while the shapes change every step
    ("maxtok-tp2xpp2-mb2", 4, MAXTOK + ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2"]),
]
BF16 = [
    ("bf16-dp2-zero0", 2, []),
    ("bf16-dp2-zero1", 2, ["--zero_stage", "1"]),
    ("bf16-dp2-zero2", 2, ["--zero_stage", "2"]),
    ("bf16-dp2-zero3", 2, ["--zero_stage", "3"]),
    ("bf16-tp2", 2, ["--mp", "2"]),
    ("bf16-pp2-mb4", 2, PP2),
    ("bf16-tp2-recompute", 2, ["--mp", "2", "--recompute", "1"]),
    ("bf16-dp2xtp2xpp2", 8, ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2"]),
]
FP16 = [
    ("fp16-dp2", 2, []),
    ("fp16-tp2", 2, ["--mp", "2"]),
    ("fp16-pp2-mb4", 2, PP2),
]
SHARE = ["--share_embeddings", "1"]
SHARED_EMBEDDINGS = [  # one table for source, target and output projection; tied across the pipeline's ends
    ("share-tp2", 2, SHARE + ["--mp", "2", "--vocab_emb_dp", "0"]),
    ("share-pp2-mb2", 2, SHARE + ["--pipeline_stage", "2", "--micro_batch_num", "2"]),
    (
        "share-tp2xpp2-mb2",
        4,
        SHARE + ["--mp", "2", "--vocab_emb_dp", "0", "--pipeline_stage", "2", "--micro_batch_num", "2"],
    ),
    ("bf16-share-pp2-mb2", 2, SHARE + ["--pipeline_stage", "2", "--micro_batch_num", "2"]),
]
DROPOUT_TP = [
    ("tp2-dropout", 2, ["--mp", "2"]),
    ("tp2xpp2-dropout", 4, ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2"]),
]
PRECISION = {name: name.split("-")[0] for name, _, _ in BF16 + FP16 + SHARED_EMBEDDINGS[3:]}
# a precision this machine's accelerator lacks (fp16 without avx512_fp16) is left out of the launches and its
# cases are skipped with the reason
RUNNABLE = {p for p in ("fp32", "bf16", "fp16") if accelerator.supported(p)}
CASES = {
    name: (nproc, flags)
    for name, nproc, flags in FP32 + TOKEN_BATCHES + BF16 + FP16 + SHARED_EMBEDDINGS + DROPOUT_TP
    if PRECISION.get(name, "fp32") in RUNNABLE
}
REFERENCES = {
    name: (precision, flags)
    for name, (precision, flags) in {
        "serial-fp32": ("fp32", []),
        "serial-bf16": ("bf16", []),
        "serial-fp16": ("fp16", []),
        "serial-fp32-share": ("fp32", SHARE),
        "serial-bf16-share": ("bf16", SHARE),
        "serial-fp32-maxtok": ("fp32", MAXTOK),
    }.items()
    if precision in RUNNABLE
}


# validated every 10 steps: the pipeline engine meets the validation's fixed shape between token batches
VALIDATED = ("maxtok-tp2xpp2-mb2", "serial-fp32-maxtok")


def _case(name: str):
    precision = PRECISION.get(name, "fp32")
    return accelerator.param(name, precision)


def reference_of(name: str) -> str:
    return (
        f"serial-{PRECISION.get(name, 'fp32')}"
        + ("-share" if "share" in name else "")
        + ("-maxtok" if name.startswith("maxtok") else "")
    )


def _args(data, out, precision, *extra):
    tsv, tok = data
    return [
        "--file_path",
        tsv,
        "--tokenizer",
        tok,
        "--steps",
        STEPS,
        "--output_dir",
        out,
        *TINY,
        "--clip_grad",
        CLIP,
        "--precision",
        precision,
        "--save_checkpoint_steps",
        STEPS,
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(multi30k_tsv, multi30k_dir, bpe_tokenizer, tmp_path_factory):
    """Output folder of every case (and of the single-process references), one launch per world size, on demand."""
    from preprocess.parallel import make_tsv

    root = tmp_path_factory.mktemp("parity")
    data = (multi30k_tsv, bpe_tokenizer)
    make_tsv(multi30k_dir / "val.fr.gz", multi30k_dir / "val.en.gz", root / "val.fr_en.tsv")
    valid = root / "val96.fr_en.tsv"  # 6 global batches: enough to meet the fixed shape, and quick
    valid.write_text("".join((root / "val.fr_en.tsv").read_text().splitlines(keepends=True)[:96]))
    done: dict = {}

    def validated(name):
        return ["--valid_file", valid, "--valid_interval", 10] if name in VALIDATED else []

    def launch(nproc):
        out = attempt_dir(root, f"world{nproc}")  # a retry after a failed launch starts in new folders
        if nproc == 1:
            batch = [
                (name, _args(data, out / name, precision, *flags, *validated(name)))
                for name, (precision, flags) in REFERENCES.items()
            ]
        else:
            batch = []
            for name, (n, flags) in CASES.items():
                if n == nproc:
                    dropout = ["--dropout", "0.1"] if name.endswith("-dropout") else []
                    batch.append(
                        (name, _args(data, out / name, PRECISION.get(name, "fp32"), *flags, *dropout, *validated(name)))
                    )
        run_many(nproc, [argv for _, argv in batch], out)
        done.update({name: out / name for name, _ in batch})

    def get(name):
        if name not in done:
            launch(1 if name.startswith("serial-") else CASES[name][0])
        return done[name]

    return get


def merged_model(out):
    return merged(out)["model"]


def rel(a, b):
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def serial(runs):
    """The single-process reference of each precision: metrics and merged weights."""
    refs = {}
    for name in REFERENCES:
        out = runs(name)
        metrics = read_metrics(out)
        assert len(metrics) == STEPS and metrics[-1]["loss"] < metrics[0]["loss"] - 0.5, metrics  # it learns
        assert min(r["grad_norm"] for r in metrics) > CLIP  # clipping acts on every step
        refs[name] = (metrics, out)
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in FP32 + TOKEN_BATCHES + SHARED_EMBEDDINGS[:3]])
def test_fp32_layout_with_clipping_matches_single_process(name, runs, serial):
    ref, ref_out = serial[reference_of(name)]
    got = read_metrics(runs(name))
    assert len(got) == STEPS
    loss = [rel(g["loss"], r["loss"]) for g, r in zip(got, ref)]
    norm = [rel(g["grad_norm"], r["grad_norm"]) for g, r in zip(got, ref)]
    a, b = merged_model(runs(name)), merged_model(ref_out)
    assert a.keys() == b.keys()
    weights = {k: float((a[k] - b[k]).pow(2).mean().sqrt()) / LR for k in b}
    worst = max(weights, key=weights.get)
    print(
        f"PARITY {name}: loss first {loss[0]:.2e} worst {max(loss):.2e}; grad_norm worst {max(norm):.2e}; "
        f"weights worst RMS {weights[worst]:.2e}·lr ({worst})"
    )
    info = json.loads((runs(name) / "run.json").read_text())
    # with tp and pp both > 1 the stage boundaries are split over the TP ranks on the wire, in both directions
    split = info["mp"] > 1 and info["pp"] > 1
    assert (info["pipe_partitioned"], info["grad_partitioned"]) == (split, split), info
    assert loss[0] <= 1e-6 and max(loss) <= 1e-5, list(zip(got, ref))
    assert max(norm) <= 1e-5, [(g["grad_norm"], r["grad_norm"]) for g, r in zip(got, ref)]
    assert weights[worst] <= 1e-2, sorted(weights.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.slow
@pytest.mark.parametrize("name", [_case(c[0]) for c in BF16 + FP16 + SHARED_EMBEDDINGS[3:]])
def test_half_precision_layout_matches_single_process(name, runs, serial):
    ref, _ = serial[reference_of(name)]
    got = read_metrics(runs(name))
    assert len(got) == STEPS
    loss = max(rel(g["loss"], r["loss"]) for g, r in zip(got, ref))
    norm = max(rel(g["grad_norm"], r["grad_norm"]) for g, r in zip(got, ref))
    info = json.loads((runs(name) / "run.json").read_text())
    print(
        f"PARITY {name}: loss worst {loss:.2e} (tol {HALF_LOSS_TOL:.0e}); grad_norm worst {norm:.2e} "
        f"(tol {HALF_NORM_TOL:.0e}); {info['optimizer']}, gradient accumulation in {info['grad_accum_dtype']}, "
        f"reduction in {info['grad_reduce_dtype']}"
    )
    assert info["precision"] == PRECISION[name] and info["grad_accum_dtype"] == "float32", info
    assert info["grad_reduce_dtype"] == "float32" and info["grad_reduce_overlap"] is False, info  # CPU: no overlap
    assert info["pipe_partitioned"] == (info["mp"] > 1 and info["pp"] > 1), info
    assert info["optimizer"] == (
        "BF16_Optimizer"
        if info["precision"] == "bf16" and info["zero_stage"] == 1
        else "DeepSpeedZeroOptimizer_Stage3"
        if info["zero_stage"] == 3
        else "DeepSpeedZeroOptimizer"
    ), info
    assert loss <= HALF_LOSS_TOL, [(g["loss"], r["loss"]) for g, r in zip(got, ref)]
    assert norm <= HALF_NORM_TOL, [(g["grad_norm"], r["grad_norm"]) for g, r in zip(got, ref)]


@pytest.mark.slow
def test_validation_between_token_batches_on_split_pipeline_boundaries(runs, serial):
    """tp2×pp2 with token batches validates at steps 10 and 20 on the validation set's fixed shape between
    training steps of other shapes (the split boundaries' cached layout is reset at every change: Engine.
    expect_shape): valid_loss as the single-process run's, and training after it unchanged (the fp32 test above)."""

    def valid(name):
        return [(r["step"], r["valid_loss"]) for r in read_metrics(runs(name)) if "valid_loss" in r]

    got, want = valid("maxtok-tp2xpp2-mb2"), valid("serial-fp32-maxtok")
    assert [s for s, _ in got] == [s for s, _ in want] == [10, 20]
    assert max(rel(g, w) for (_, g), (_, w) in zip(got, want)) <= 1e-5, (got, want)


@pytest.mark.slow
def test_half_precision_references_track_fp32(serial):
    """The bf16 and fp16 single-process runs themselves stay within bf16's rounding of the fp32 run, and fp16
    reports its dynamic loss scale every step."""
    fp32 = serial["serial-fp32"][0]
    halves = [p for p in ("bf16", "fp16") if p in RUNNABLE]
    if not halves:
        pytest.skip(accelerator.reason("bf16 or fp16"))
    for precision in halves:
        got = serial[f"serial-{precision}"][0]
        worst = max(rel(g["loss"], r["loss"]) for g, r in zip(got, fp32))
        print(f"PARITY serial {precision} vs fp32: loss worst {worst:.2e}")
        assert worst <= HALF_LOSS_TOL
    if "fp16" in RUNNABLE:
        assert all(r["loss_scale"] >= 1 and math.isfinite(r["loss_scale"]) for r in serial["serial-fp16"][0])


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in DROPOUT_TP])
def test_dropout_keeps_replicated_parameters_identical_on_tp_ranks(name, runs):
    from training.checkpoint.folder import resolve
    from training.checkpoint.format import read_shard

    ckpt = resolve(str(runs(name)))
    nproc, flags = CASES[name]
    pp = int(flags[flags.index("--pipeline_stage") + 1]) if "--pipeline_stage" in flags else 1
    compared = 0
    for stage in range(pp):
        tp0, tp1 = read_shard(ckpt, stage, 0), read_shard(ckpt, stage, 1)
        for key, entry in tp0.items():
            if entry["partition_dim"] is None:
                assert torch.equal(entry["param"], tp1[key]["param"]), key
                compared += 1
            else:  # sharded parameters differ between ranks; a sanity check that we compare real shards
                assert not torch.equal(entry["param"], tp1[key]["param"]), key
    assert compared >= 10
    losses = [r["loss"] for r in read_metrics(runs(name))]
    assert losses[-1] < losses[0] - 0.5  # it trained, with dropout on


@pytest.mark.slow
@pytest.mark.parametrize("name,world", [("dp2-zero1", 2), ("dp4-zero1", 4)])
def test_plan_predicts_the_optimizer_state_deepspeed_allocates(name, world, runs, multi30k_tsv, bpe_tokenizer):
    """plan.py's memory model against DeepSpeed's real allocations: the optimizer state (fp32 master partition +
    AdamW moments) rank 0 holds after training under ZeRO-1, as the engine reports it (run.json), within 5% of
    what plan.py predicts for the same flags and world (DeepSpeed pads partitions for alignment)."""
    from training.config.flags import parse_args
    from training.config.sections import TrainConfig
    from training.plan import planner as P

    got = json.loads((runs(name) / "run.json").read_text())["optimizer_state_bytes_rank0"]
    flags = ["--tokenizer", bpe_tokenizer, *TINY, *CASES[name][1], "--vocab_size", "8000"]
    config = TrainConfig.from_flags(parse_args([str(f) for f in flags], parser=P.build_plan_parser()))
    want = P.make_plan(config, world)["ranks"][0]
    print(
        f"PLAN {name}: DeepSpeed holds {got:,} B of optimizer state on rank 0, plan.py predicts "
        f"{want['optimizer_bytes']:,} B ({got / want['optimizer_bytes'] - 1:+.2%})"
    )
    assert abs(got / want["optimizer_bytes"] - 1) <= 0.05
