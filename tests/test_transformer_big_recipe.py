"""recipes/transformer-big-wmt14-en-fr: the paper's big model in every layout's JSON, layouts the plan accepts, and
its run.sh end to end on CPU at a tiny size (sizes overridden by flags, bundled Multi30k)."""

import json

import pytest

from tests import accelerator
from tests.launch import REPO_ROOT, only_launch, only_run_dir, read_metrics, run_script, script_env
from training.config.flags import load_recipe, parse_args
from training.config.sections import TrainConfig
from training.plan.planner import build_plan_parser, configs

FOLDER = REPO_ROOT / "recipes" / "transformer-big-wmt14-en-fr"
LAYOUTS = {
    "transformer-big-wmt14-en-fr.json": 1,
    "transformer-big-wmt14-en-fr-8gpu.json": 8,
    "transformer-big-wmt14-en-fr-16gpu.json": 16,
}
BIG = {
    "d_model": 1024,
    "num_heads": 16,
    "ffn_size": 4096,
    "encoder_layer": 6,
    "decoder_layer": 6,
    "share_embeddings": True,
    "tokenizer_vocab_size": 32000,
    "vocab_size": 32000,
    "dropout": 0.3,
    "label_smoothing": 0.1,
}
SCHEDULE = {"lr_schedule": "inverse_sqrt", "warmup_steps": 4000}
TOKENS_PER_GPU = 25000


@pytest.mark.parametrize("name,world", LAYOUTS.items())
def test_every_layout_holds_transformer_big_and_the_plan_accepts_it(name, world):
    raw = json.loads((FOLDER / name).read_text())
    assert {k: raw["model"][k] for k in BIG} == BIG
    assert {k: raw["training"][k] for k in SCHEDULE} == SCHEDULE
    assert raw["parallel"]["precision"] == "bf16" and raw["parallel"]["world_size"] == world
    assert raw["training"]["max_tokens"] == TOKENS_PER_GPU * world  # the same tokens per GPU at any size
    assert raw["_comment"] and raw["_plan"] and raw["training"]["_batch"] and name in (FOLDER / "run.sh").read_text()
    load_recipe(str(FOLDER / name))  # no unknown key, every value of the flag's type
    args = parse_args(["--recipe", str(FOLDER / name)], parser=build_plan_parser())
    _, parallel = configs(TrainConfig.from_flags(args), world)
    assert parallel.data_parallel == world


@pytest.mark.slow
def test_the_recipe_runs_end_to_end_at_a_tiny_size(multi30k_tsv, bpe_tokenizer, tmp_path):
    """run.sh as a user runs it, sizes overridden: 4 steps of token batches, inverse_sqrt warmup, label smoothing,
    shared embeddings, bf16 where this CPU computes in it (else fp32), and the loss goes down."""
    runs = tmp_path / "runs"
    precision = [] if accelerator.supported("bf16") else ["--precision", "fp32"]
    tiny = [
        "--d_model",
        32,
        "--num_heads",
        4,
        "--ffn_size",
        64,
        "--encoder_layer",
        2,
        "--decoder_layer",
        2,
        "--src_len",
        32,
        "--tgt_len",
        32,
        "--max_tokens",
        1024,
        "--warmup_steps",
        4,
        "--lr",
        3e-3,
        "--vocab_size",
        8000,
        "--dropout",
        0,
        "--steps",
        6,
        "--log_interval",
        1,
        "--tensorboard",
        0,
    ]
    proc = run_script(
        str(FOLDER / "run.sh"),
        [multi30k_tsv, "--tokenizer", bpe_tokenizer, *tiny, *precision],
        script_env(runs),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(runs)
    assert run_dir.name == "transformer-big-wmt14-en-fr"
    metrics = read_metrics(run_dir / "output")
    assert [r["step"] for r in metrics] == list(range(1, 7))
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert [round(r["lr"] / 3e-3, 6) for r in metrics[:5]] == [0.25, 0.5, 0.75, 1.0, round((4 / 5) ** 0.5, 6)]
    info = json.loads((run_dir / "output" / "run.json").read_text())
    assert info["precision"] == (precision[1] if precision else "bf16") and info["world"] == 1
    assert "transformer-big-wmt14-en-fr.json" in (only_launch(run_dir) / "command.sh").read_text()


def test_layout_16_needs_a_hostfile(tmp_path):
    proc = run_script(
        str(FOLDER / "run.sh"), [tmp_path / "train.tsv"], dict(script_env(tmp_path), LAYOUT="16"), timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith("error: LAYOUT=16 needs a HOSTFILE")
