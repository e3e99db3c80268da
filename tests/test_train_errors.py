"""Bad configurations fail before training, in seconds, with one `error:` line — no hang, no traceback.

Most run as one process (the layout check reports every rule a layout breaks in one line, the world size among
them), two at a time; the ZeRO-2 + pipeline case runs under DeepSpeed's launcher on 2 processes, to prove no rank
hangs waiting for another. Values a flag does not accept (NaN, infinities, negatives, zero sizes, a seed numpy
refuses, lengths past the positions attention can hold) are refused while the flags are parsed, in train.py,
plan.py and a recipe alike: exit 2 and one line naming the flag (or recipe key), the value and the range.
"""

import json
import sys
import time

import pytest

from tests import accelerator
from tests.launch import REPO_ROOT, TINY, concurrently, env, run_python, run_train, usage_error
from tests.progress import load_factor, scaled

CASES = [
    # (flags, processes, words the message must contain)
    (["--mp", "2"], 1, ["= 2 but the world has 1 processes", "Layouts that fit 1 processes: dp=1 mp=1 pp=1"]),
    (["--mp", "2", "--num_heads", "3", "--d_model", "33"], 1, ["num_heads=3 is not divisible by model_parallel=2"]),
    (["--mp", "2", "--ffn_size", "63"], 1, ["FFN size=63 is not divisible by model_parallel=2"]),
    (
        ["--batch_size", "15", "--micro_batch_num", "2"],
        1,
        ["global batch_size=15 is not divisible by data_parallel×micro_batch_num = 1×2", "try batch_size 14 or 16"],
    ),
    (["--pipeline_stage", "2", "--zero_stage", "2"], 2, ["ZeRO stage 2 cannot be combined with pipeline_stage=2"]),
    (["--vocab_size", "100"], 1, ["--vocab_size 100 is smaller than the tokenizer's vocabulary (8000)"]),
    # refused on every machine, before the precision check (DeepSpeed would not sum the tied gradients: issue 23)
    (
        ["--precision", "fp16", "--pipeline_stage", "2", "--share_embeddings", "1"],
        1,
        ["--precision fp16 with --pipeline_stage 2 and --share_embeddings 1", "use --precision bf16 or fp32"],
    ),
    (
        ["--interleave_num", "3"],
        1,
        ["interleave_num=3 does not divide the micro-batch of 16 samples per rank", "use interleave_num 1, 2, 4 or 8"],
    ),
]


MISSING = [
    ("data", ["--file_path", "/nonexistent/train.tsv"], "--file_path /nonexistent/train.tsv not found"),
    ("tokenizer", ["--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer /nonexistent/tokenizer.json not found"),
    ("no data", ["--file_path", ""], "--file_path is required"),
    ("recipe", ["--recipe", "/nonexistent.json"], "recipe /nonexistent.json not found"),
]


@pytest.fixture(scope="module")
def outcomes(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    """Every train.py run of this file, started two at a time (each spends most of its seconds importing torch on
    one core): {key: (completed process, seconds, its output folder)}."""
    jobs = {}
    for extra, nproc, _ in CASES:
        jobs[("config", " ".join(extra))] = (nproc, ["--steps", 2, *extra])
    jobs[("stages",)] = (1, ["--pipeline_stage", "5"])
    for what, extra, _ in MISSING:
        jobs[("missing", what)] = (1, extra)
    if not accelerator.supported("fp16"):
        jobs[("fp16",)] = (1, ["--steps", 1, "--precision", "fp16"])

    def one(key, nproc, extra):
        out = tmp_path_factory.mktemp("bad")
        start = time.time()
        # the 2-process case goes through DeepSpeed's own launcher: no rank may hang waiting for another
        proc = run_train(
            nproc,
            ["--file_path", multi30k_tsv, "--tokenizer", bpe_tokenizer, "--output_dir", out, *TINY, *extra],
            check=False,
            timeout=120,
            launcher="deepspeed",
        )
        return proc, time.time() - start, out

    results = concurrently(*[lambda k=k, n=n, e=e: one(k, n, e) for k, (n, e) in jobs.items()])
    return dict(zip(jobs, results))


@pytest.mark.parametrize("extra,nproc,needles", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_config_fails_fast_with_message(extra, nproc, needles, outcomes):
    proc, seconds, out = outcomes[("config", " ".join(extra))]
    assert proc.returncode != 0
    errors = [line for line in (proc.stderr + proc.stdout).splitlines() if "error: " in line]
    assert errors, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    if nproc == 1:
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()  # failed before the first step
    assert seconds < scaled(90), f"{seconds:.0f} s at load factor {load_factor():.1f}"


def test_more_stages_than_blocks(outcomes):
    proc, _, _ = outcomes[("stages",)]
    assert "pipeline_stage=5 > 4 blocks" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("what,extra,needle", MISSING)
def test_missing_files(what, extra, needle, outcomes):
    proc, _, _ = outcomes[("missing", what)]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and needle in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_half_precision_the_accelerator_lacks_is_refused(monkeypatch):
    """An accelerator that cannot compute in a half precision is refused by name with what it supports (on a CPU
    without avx512_fp16 that is fp16 for real: see test_precision_this_machine_lacks_is_refused_by_train_py).
    DeepSpeed's accelerator is real; only its answer is narrowed here."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from common.errors import UserError
    from training.core.engine import check_precision

    acc = get_accelerator()
    monkeypatch.setattr(acc, "supported_dtypes", lambda: [torch.float32, torch.bfloat16])
    check_precision("bf16")
    with pytest.raises(UserError) as err:
        check_precision("fp16")
    assert str(err.value) == (
        f"--precision fp16: DeepSpeed's {acc.device_name()} accelerator supports fp32, bf16 on "
        f"this machine; use --precision bf16"
    )


@pytest.mark.skipif(accelerator.supported("fp16"), reason="this machine computes in fp16 (nothing to refuse)")
def test_precision_this_machine_lacks_is_refused_by_train_py(outcomes, assert_user_error):
    """The real refusal, end to end: train.py --precision fp16 on an accelerator without fp16 (this CPU)."""
    proc, _, out = outcomes[("fp16",)]
    line = assert_user_error(proc, "--precision fp16", "accelerator supports fp32")
    assert not (out / "metrics.jsonl").exists(), line


# ------------------------------------------------------------------------------------ values a flag does not accept
FLOAT_FLAGS = {  # flag → the range its refusal states
    "--lr": ">= 0",
    "--weight_decay": ">= 0",
    "--clip_grad": ">= 0",
    "--min_lr_ratio": "in [0, 1]",
    "--lr_power": "> 0",
    "--dropout": "in [0, 1)",
    "--attention_dropout": "in [0, 1)",
    "--label_smoothing": "in [0, 1)",
    "--comm_timeout": "in (0, 1000000000]",
}
BAD_VALUES = [  # (train.py arguments, the start of its one error line)
    *[
        (
            [flag, value],
            f"error: {flag} {value} must be {'a finite number ' if value in ('nan', 'inf') else ''}{bounds}",
        )
        for flag, bounds in FLOAT_FLAGS.items()
        for value in ("nan", "inf", "-1")
    ],
    (["--clip_grad", "-inf"], "error: --clip_grad -inf must be a finite number >= 0 (0 turns clipping off)"),
    (["--weight_decay", "-1e-3"], "error: --weight_decay -1e-3 must be >= 0"),
    (["--label_smoothing", "1"], "error: --label_smoothing 1 must be in [0, 1)"),
    (["--dropout", "1.0"], "error: --dropout 1.0 must be in [0, 1)"),
    (["--min_lr_ratio", "1.5"], "error: --min_lr_ratio 1.5 must be in [0, 1] (a fraction of --lr)"),
    (["--lr_power", "0"], "error: --lr_power 0 must be > 0"),
    (["--comm_timeout", "0"], "error: --comm_timeout 0 must be in (0, 1000000000] (seconds)"),
    (["--adam_beta1", "1"], "error: --adam_beta1 1 must be in [0, 1) (AdamW's first-moment decay)"),
    (["--adam_beta2", "nan"], "error: --adam_beta2 nan must be a finite number in [0, 1)"),
    (["--adam_eps", "0"], "error: --adam_eps 0 must be > 0"),
    (["--decay_steps", "0"], "error: --decay_steps 0 must be >= 1"),
    # the probe's values
    (["--batch_size", "-4"], "error: --batch_size -4 must be >= 1"),
    (["--ffn_size", "-1"], "error: --ffn_size -1 must be >= 0 (0 = d_model)"),
    (["--seed", "-1"], "error: --seed -1 must be in [0, 4294967295]"),
    (["--seed", "1e23"], "error: --seed 1e23 must be an integer in [0, 4294967295]"),
    (["--seed", str(2**32)], "error: --seed 4294967296 must be in [0, 4294967295]"),
    (
        ["--src_len", "100000"],
        "error: --src_len 100000 must be in [2, 16384] (at least one token plus BOS/EOS; at most 16384 positions",
    ),
    (["--tgt_len", "16385"], "error: --tgt_len 16385 must be in [2, 16384]"),
    (["--src_len", "1"], "error: --src_len 1 must be in [2, 16384]"),
    # sizes and counts where zero or less means nothing
    *[
        ([flag, "0"], f"error: {flag} 0 must be >= 1")
        for flag in (
            "--mp",
            "--pipeline_stage",
            "--micro_batch_num",
            "--batch_size",
            "--d_model",
            "--num_heads",
            "--vocab_size",
            "--data_parallel",
            "--gradient_aggregation_group",
            "--interleave_num",
            "--batch_multiple",
            "--pad_multiple",
            "--epochs",
            "--log_interval",
            "--nan_skip_limit",
        )
    ],
    *[
        ([flag, "-1"], f"error: {flag} -1 must be >= 0")
        for flag in (
            "--steps",
            "--warmup_steps",
            "--max_tokens",
            "--valid_interval",
            "--early_stop_patience",
            "--save_checkpoint_steps",
            "--keep_checkpoint_max",
            "--num_batch_buckets",
        )
    ],
    # layer counts: at least one, at most 1000 (100000 + 100000 once planned for minutes without a word)
    (["--encoder_layer", "0"], "error: --encoder_layer 0 must be in [1, 1000] (blocks of this stack"),
    (["--decoder_layer", "100000"], "error: --decoder_layer 100000 must be in [1, 1000] (blocks of this stack"),
    (["--tokenizer_vocab_size", "4"], "error: --tokenizer_vocab_size 4 must be >= 5 (more than the 4 special tokens)"),
    (["--batch_size", "3.5"], "error: --batch_size 3.5 must be an integer >= 1"),
    (["--lr", "fast"], "error: --lr fast must be a finite number >= 0"),
    # argparse's own refusals read the same way
    (["--zero_stage", "5"], "error: --zero_stage invalid choice: 5 (choose from 0, 1, 2, 3)"),
    (["--batch_size"], "error: --batch_size expected one argument"),
]
RECIPES = [  # (a recipe, the start of train.py's error line after "error: recipe PATH: ")
    ({"training": {"clip_grad": float("nan")}}, "training.clip_grad is NaN; it must be a finite number >= 0"),
    ({"training": {"weight_decay": -1}}, "training.weight_decay is -1; it must be >= 0"),
    ({"training": {"seed": -1}}, "training.seed is -1; it must be in [0, 4294967295]"),
    ({"training": {"seed": 1e23}}, "training.seed is 1e+23; it must be an integer in [0, 4294967295]"),
    ({"model": {"src_len": 100000}}, "model.src_len is 100000; it must be in [2, 16384]"),
    ({"model": {"dropout": float("inf")}}, "model.dropout is Infinity; it must be a finite number in [0, 1)"),
    ({"parallel": {"model_parallel": 0}}, "parallel.model_parallel is 0; it must be >= 1"),
]
PLAN = str(REPO_ROOT / "run_scripts" / "plan.py")
PLAN_VALUES = [  # plan.py shares train.py's flags and adds its own
    (["--world_size", "2", "--clip_grad", "nan"], "error: --clip_grad nan must be a finite number >= 0"),
    (["--world_size", "0"], "error: --world_size 0 must be >= 1"),
    (["--world_size", "2", "--gpus_per_node", "-8"], "error: --gpus_per_node -8 must be >= 1"),
    (["--world_size", "2", "--device_memory", "nan"], "error: --device_memory nan must be a finite number > 0"),
    (["--world_size", "2", "--step_time_1gpu", "0"], "error: --step_time_1gpu 0 must be > 0"),
    (["--world_size", "2", "--assumed_mfu", "1.5"], "error: --assumed_mfu 1.5 must be in (0, 1]"),
    (["--world_size", "2", "--intra_node_GB_s", "-1"], "error: --intra_node_GB_s -1 must be > 0"),
    (
        ["--world_size", "2", "--encoder_layer", "100000", "--decoder_layer", "100000"],
        "error: --encoder_layer 100000 must be in [1, 1000]",
    ),
    (["--world_size", "2", "--inter_node_Gb_s", "nan"], "error: --inter_node_Gb_s nan must be a finite number > 0"),
    (["--world_size", "2", "--save_GB_s", "0"], "error: --save_GB_s 0 must be > 0"),
    (["--world_size", "2", "--trials", "-1", "--search"], "error: --trials -1 must be >= 0"),
    (["--world_size", "2", "--top", "0", "--search"], "error: --top 0 must be >= 1"),
    (["--world_size", "2", "--trial_steps", "2", "--search"], "error: --trial_steps 2 must be >= 5"),
    (["--world_size", "2", "--trial_timeout", "0", "--search"], "error: --trial_timeout 0 must be > 0"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Every value above, train.py's flags, recipes and plan.py's, two at a time (each refusal is a process that
    parses its flags and exits: no data, no model): {key: (completed process, its output folder)}."""
    root = tmp_path_factory.mktemp("values")
    jobs = {}

    def train(argv: list, out):
        return run_train(1, [*argv, "--output_dir", out], check=False), out

    for i, (argv, _) in enumerate(BAD_VALUES):
        jobs[("train", *argv)] = lambda a=argv, o=root / f"flag{i}": train(a, o)
    for i, (recipe, _) in enumerate(RECIPES):
        path = root / f"recipe{i}.json"
        path.write_text(json.dumps(recipe))  # json writes NaN and Infinity, as it reads them
        jobs[("recipe", i)] = lambda p=path, o=root / f"recipe{i}": train(["--recipe", p], o)
    for argv, _ in PLAN_VALUES:
        jobs[("plan", *argv)] = lambda a=argv: (run_python([sys.executable, PLAN, *a], env=env()), None)
    return dict(zip(jobs, concurrently(*jobs.values())))


def refused(outcome, start: str) -> None:
    """A usage error (exit status 2), its one line on stderr beginning with `start`, nothing written."""
    proc, out = outcome
    line = usage_error(proc, alone=True)
    assert line.startswith(start), (start, line)
    assert out is None or not out.exists()  # refused before anything was written


@pytest.mark.parametrize("argv,start", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_a_value_the_flag_does_not_accept_is_one_line(argv, start, refusals):
    refused(refusals[("train", *argv)], start)


@pytest.mark.parametrize("i", range(len(RECIPES)), ids=[json.dumps(r) for r, _ in RECIPES])
def test_a_recipe_value_is_checked_as_its_flag_naming_the_key(i, refusals, tmp_path_factory):
    refused(refusals[("recipe", i)], "error: recipe ")
    proc = refusals[("recipe", i)][0]
    assert proc.stderr.split(": ", 2)[2].startswith(RECIPES[i][1]), proc.stderr
    assert f"recipe{i}.json" in proc.stderr


@pytest.mark.parametrize("argv,start", PLAN_VALUES, ids=[" ".join(a) for a, _ in PLAN_VALUES])
def test_plan_py_refuses_the_same_values(argv, start, refusals):
    refused(refusals[("plan", *argv)], start)


def test_every_numeric_flag_has_a_range():
    """No numeric flag of train.py / plan.py is a bare int or float (which takes nan, -1, 1e23 ...), and each range
    is one the tests above exercise or that is stated here."""
    from common.cli_args import Number
    from training.plan.planner import build_plan_parser

    bare = [
        a.option_strings[0]
        for a in build_plan_parser()._actions
        if a.type in (int, float) and a.choices is None and a.dest != "local_rank"
    ]
    assert bare == []
    tried = {argv[0] for argv, _ in BAD_VALUES + PLAN_VALUES} | {argv[2] for argv, _ in PLAN_VALUES if len(argv) > 2}
    untried = [
        a.option_strings[0]
        for a in build_plan_parser()._actions
        if isinstance(a.type, Number) and not tried & set(a.option_strings)
    ]  # any spelling tried
    assert untried == []
