"""The Multi30k translation recipes (recipes/multi30k-en-fr, multi30k-fr-en): complete folders whose comments say
what the JSON holds, and the whole pipeline of run_scripts/translation_recipe.sh run end to end as a user runs it —
data, BPE, training with validation, checkpoint averaging, beam search on val and both test sets, the results table —
with a tiny model and a few steps (the real recipe trains for hours; its figures are in the README)."""

import json
import os
import re
import sys

import pytest

from tests.launch import REPO_ROOT, run_python, run_script, script_env
from tests.progress import scaled
from training.config.flags import load_recipe, parse_args

TRANSLATION = {"multi30k-en-fr": ("en", "fr"), "multi30k-fr-en": ("fr", "en")}
TEST_SETS = ("val", "test_2016_flickr", "test_2017_flickr")


@pytest.mark.parametrize("name", list(TRANSLATION))
def test_translation_recipe_folder_is_complete(name):
    src, tgt = TRANSLATION[name]
    folder = REPO_ROOT / "recipes" / name
    launcher = folder / "run.sh"
    assert launcher.is_file() and os.access(launcher, os.X_OK)
    body = launcher.read_text()
    assert f'translation_recipe.sh" {src} {tgt} "$HERE/{name}.json"' in body
    raw = json.loads((folder / f"{name}.json").read_text())
    load_recipe(str(folder / f"{name}.json"))  # no unknown key, every value of the flag's type
    args = parse_args(["--recipe", str(folder / f"{name}.json")])
    batch = raw["training"]["_batch"]  # the comment states the token budget the JSON sets
    assert f"up to {args.max_tokens} tokens" in batch and f"batch_multiple {args.batch_multiple}" in batch
    assert f"dropout {args.dropout}" in raw["model"]["_why"]  # and the settings its comments explain
    assert raw["training"]["_why"].startswith(f"{args.epochs} epochs")
    assert args.share_embeddings and args.valid_file is None  # run.sh supplies the data and validation
    vocab = re.search(r"VOCAB=\"\$\{VOCAB:-(\d+)\}\"", body).group(1)
    assert f"({int(vocab):,} tokens" in raw["_comment"] and f"--vocab_size {vocab}" in raw["_plan"]
    readme = (REPO_ROOT / "recipes" / "README.md").read_text()
    assert f"[`{name}`]({name}/{name}.json)" in readme


@pytest.mark.slow
def test_translation_recipe_end_to_end(tmp_path):
    """recipes/multi30k-en-fr/run.sh OUT with a tiny model: every stage runs and the table has a row per set with
    the scores evaluate.py printed; a second start finds the training complete and only scores again."""
    out = tmp_path / "enfr"
    env = script_env(tmp_path / "runs", VOCAB="400", AVERAGE="2", BEAM="2", LIMIT="24")
    tiny = [
        "--d_model",
        32,
        "--num_heads",
        2,
        "--ffn_size",
        64,
        "--encoder_layer",
        1,
        "--decoder_layer",
        1,
        "--steps",
        7,
        "--save_checkpoint_steps",
        2,
        "--max_tokens",
        1024,
        "--warmup_steps",
        2,
        "--log_interval",
        2,
    ]
    proc = run_script("recipes/multi30k-en-fr/run.sh", [out, *tiny], env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for path in (
        "data/train.tsv",
        "data/val.tsv",
        "data/bpe/tokenizer.json",
        "avg.pt",
        "train_time.txt",
        "train/metrics.jsonl",
        "results.md",
    ):
        assert (out / path).is_file(), path
    records = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8)) and "valid_loss" in records[-1]
    # saved every 2 steps and at the last one, so the average holds the final weights: steps 6 and 7
    assert [a["step"] for a in json.loads((out / "val.json").read_text())["averaged"]] == [6, 7]
    assert len(json.loads((out / "data" / "bpe" / "tokenizer.json").read_text())["model"]["vocab"]) <= 400
    # token batches: the checkpoint holds the batching flags (a resume with others is refused) and the pairs
    # trained on; both, and the logged pairs per step, against the schedule rebuilt from the run's data and flags
    from preprocess.dataset import TranslationDataset
    from training.core.data import batch_schedule

    recipe = parse_args(["--recipe", str(REPO_ROOT / "recipes" / "multi30k-en-fr" / "multi30k-en-fr.json")])
    data = TranslationDataset(
        out / "data" / "train.tsv",
        out / "data" / "bpe" / "tokenizer.json",
        recipe.src_len,
        recipe.tgt_len,
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    schedule = batch_schedule(data, recipe.batch_size, recipe.seed, 1024, recipe.batch_multiple, recipe.pad_multiple)
    sizes = [len(schedule.global_batch(step)) for step in range(7)]
    meta = json.loads((out / "train" / "checkpoints" / "step_00000007" / "meta.json").read_text())
    assert meta["data_order"] == {
        "batching": "tokens",
        "max_tokens": 1024,
        "batch_multiple": recipe.batch_multiple,
        "pad_multiple": recipe.pad_multiple,
        "seed": recipe.seed,
    }
    assert [r["pairs"] for r in records] == sizes and len(set(sizes)) > 1  # token batches: sizes vary...
    assert meta["samples_seen"] == sum(sizes)  # ...and the count is theirs, not 7 × batch_size
    table = (out / "results.md").read_text()
    assert "the mean of the last 2 checkpoints, beam 2" in table and "nrefs:1|case:mixed" in table
    for name in TEST_SETS:
        scores = json.loads((out / f"{name}.json").read_text())
        assert scores["sentences"] == 24
        assert len((out / f"{name}.hyp.fr").read_text().splitlines()) == 24
        assert f"| {name} | {scores['bleu']:.2f} | {scores['chrf']:.2f} | 24 |" in table

    again = run_script("recipes/multi30k-en-fr/run.sh", [out, *tiny], env, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing to train" in again.stdout + again.stderr
    assert len((out / "train" / "metrics.jsonl").read_text().splitlines()) == 7

    # benchmarks/sweep_translation.py runs this recipe per variant on val only: with the same flags and data it
    # reproduces the recipe run's val score, and decodes no test set
    sweep = run_python(
        [
            sys.executable,
            "benchmarks/sweep_translation.py",
            "--recipe",
            "recipes/multi30k-en-fr/multi30k-en-fr.json",
            "--data",
            str(out / "data"),
            "--out",
            str(tmp_path / "sweep"),
            "--average",
            "2",
            "--beam",
            "2",
            "--variant",
            "same:" + " ".join(map(str, tiny)),
        ],
        env=env,
        timeout=600,
    )
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    ours, recipe_val = (json.loads((d / "val.json").read_text()) for d in (tmp_path / "sweep" / "same", out))
    assert (ours["bleu"], ours["chrf"], ours["sentences"]) == (recipe_val["bleu"], recipe_val["chrf"], 24)
    assert not list((tmp_path / "sweep" / "same").glob("test_*"))
    assert (
        f"| same | `{' '.join(map(str, tiny))}` | {ours['bleu']:.2f} | {ours['chrf']:.2f} |"
        in (tmp_path / "sweep" / "summary.md").read_text()
    )


def test_translation_recipe_refuses_bad_arguments(tmp_path):
    proc = run_script(
        "run_scripts/translation_recipe.sh",
        ["en", "de", "recipes/multi30k-en-fr/multi30k-en-fr.json", tmp_path / "x"],
        script_env(tmp_path),
    )
    assert proc.returncode == 2 and proc.stderr.strip() == "error: no data/multi30k/train.de.gz (languages: en, fr)"
    assert not (tmp_path / "x").exists()
    proc = run_script(
        "run_scripts/translation_recipe.sh",
        ["en", "fr", "recipes/multi30k-en-fr/multi30k-en-fr.json", tmp_path / "x"],
        script_env(tmp_path, SETS="val test_2018"),
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip()
        == "error: SETS names test_2018, but there is no "
        "data/multi30k/test_2018.en.gz (sets: val test_2016_flickr test_2017_flickr)"
    )
    assert not (tmp_path / "x").exists()


def test_the_val_sweep_refuses_a_variant_it_cannot_name(tmp_path):
    """benchmarks/sweep_translation.py (how the recipe was tuned on val): a --variant without NAME: is one error line
    naming the variant and the form, before anything trains."""
    import subprocess

    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/sweep_translation.py",
            "--recipe",
            "x.json",
            "--data",
            "d",
            "--out",
            str(tmp_path / "sweep"),
            "--variant",
            "ok:--lr 1e-3",
            "--variant",
            "--dropout 0.1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 2 and "--variant '--dropout 0.1': expected NAME:FLAGS" in proc.stderr, proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/sweep_translation.py",
            "--recipe",
            "x.json",
            "--data",
            str(tmp_path),
            "--out",
            str(tmp_path / "sweep"),
            "--variant",
            "ok:",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 2 and f"--data {tmp_path} lacks train.tsv, val.tsv, bpe/tokenizer.json" in proc.stderr
    assert not (tmp_path / "sweep").exists()
