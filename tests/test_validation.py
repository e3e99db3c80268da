"""Validation during training: valid_loss is the same under every layout and equals an independent computation on
the saved best checkpoint; validating does not disturb training; early stopping; bad --valid_file input."""

import json

import pytest
import torch
import torch.nn.functional as F

from tests.launch import read_metrics, run_many, run_train, train_flags
from tests.progress import scaled


@pytest.fixture(scope="module")
def valid_tsv(multi30k_dir, tmp_path_factory):
    from preprocess.parallel import make_tsv

    out = tmp_path_factory.mktemp("valid") / "val.fr_en.tsv"
    make_tsv(multi30k_dir / "val.fr.gz", multi30k_dir / "val.en.gz", out)
    return out


def independent_valid_loss(ckpt, tok, valid_tsv):
    """Σ token cross-entropy / tokens over the whole validation set with the merged checkpoint in one process and
    torch's own cross-entropy (not the vocab-parallel one training uses)."""
    from merge_checkpoint import merge

    from model.config import ModelConfig
    from model.transformer import Seq2SeqTransformer
    from preprocess.dataset import TranslationDataset

    merged = merge(str(ckpt))
    cfg = ModelConfig(**merged["model_config"])
    model = Seq2SeqTransformer(cfg).eval()
    model.load_state_dict(merged["model"])
    data = TranslationDataset(valid_tsv, tok, cfg.src_len, cfg.tgt_len, progress=False)
    b = data.batch(range(data.num_samples))
    with torch.no_grad():
        logits = model.logits(b["src_ids"], b["tgt_ids"])
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), b["labels"].flatten(), ignore_index=cfg.pad_id, reduction="sum"
        )
    return float(loss) / int((b["labels"] != cfg.pad_id).sum()), merged["step"]


def independent_bleu(ckpt, tok, small_valid):
    """sacreBLEU of greedy translations of the validation sources by the saved checkpoint, through the Translator
    library evaluate.py uses (not the training-time path)."""
    import sacrebleu

    from preprocess.textio import read_tsv_pairs
    from training.evaluation.translator import Translator

    sources, refs = read_tsv_pairs(small_valid)
    hyps = Translator.load(str(ckpt), str(tok), device="cpu").translate(sources).hypotheses
    return sacrebleu.corpus_bleu(hyps, [refs]).score


@pytest.mark.slow
def test_valid_loss_is_layout_free_exact_and_harmless(multi30k_tsv, bpe_tokenizer, valid_tsv, tmp_path):
    import sys

    from tests.launch import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "run_scripts"))
    common = ["--steps", 6, "--valid_file", valid_tsv, "--valid_interval", 3]
    small_valid = tmp_path / "val100.tsv"  # --valid_bleu: greedy decoding of 100 sentences
    small_valid.write_text("".join(valid_tsv.read_text().splitlines(keepends=True)[:100]))
    # long enough at lr 1e-2 for real (if poor) translations: BLEU > 0; translated at step 60, dropout on
    no_bleu = [
        "--steps",
        120,
        "--valid_file",
        small_valid,
        "--valid_interval",
        60,
        "--lr",
        "1e-2",
        "--dropout",
        0.1,
        "--save_checkpoint_steps",
        120,
    ]
    run_many(
        1,
        [
            train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / "serial", *common),
            train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / "dropout", *common, "--dropout", 0.1),
            train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / "dropout-no-valid", "--steps", 6, "--dropout", 0.1),
            train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / "serial-bleu", *no_bleu, "--valid_bleu", 1),
            train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / "serial-no-bleu", *no_bleu),
        ],
        tmp_path,
    )
    run_many(
        2,
        [
            train_flags(multi30k_tsv, bpe_tokenizer, tmp_path / "tp2", *common, "--mp", 2),
            train_flags(
                multi30k_tsv, bpe_tokenizer, tmp_path / "pp2", *common, "--pipeline_stage", 2, "--micro_batch_num", 2
            ),
            # continues serial-bleu on 2 stages: its valid_bleu comes from weights consolidated from pp2
            train_flags(
                multi30k_tsv,
                bpe_tokenizer,
                tmp_path / "pp2-bleu",
                *no_bleu,
                "--valid_bleu",
                1,
                "--steps",
                121,
                "--ckpt_file",
                tmp_path / "serial-bleu",
                "--pipeline_stage",
                2,
                "--micro_batch_num",
                2,
            ),
        ],
        tmp_path,
    )
    # valid_bleu — from the whole model in one process, and from the weights consolidated out of pp2's stages —
    # equals translating that run's best checkpoint afterwards; the temporary checkpoint is gone
    for name in ("serial-bleu", "pp2-bleu"):
        last = read_metrics(tmp_path / name)[-1]
        meta = json.loads((tmp_path / name / "checkpoints" / "best" / "meta.json").read_text())
        assert meta["step"] == last["step"] and last["valid_bleu"] > 0, last
        assert last["valid_bleu"] == pytest.approx(
            independent_bleu(tmp_path / name / "checkpoints" / "best", bpe_tokenizer, small_valid), abs=1e-9
        )
        assert not (tmp_path / name / "checkpoints" / ".valid_bleu").exists()
    # translating at step 60 (dropout on) leaves the rest of training untouched
    with_bleu = read_metrics(tmp_path / "serial-bleu")
    assert "valid_bleu" in with_bleu[59]
    assert [r["loss"] for r in with_bleu] == [r["loss"] for r in read_metrics(tmp_path / "serial-no-bleu")]
    serial = read_metrics(tmp_path / "serial")
    valid = {
        name: [r["valid_loss"] for r in read_metrics(tmp_path / name) if "valid_loss" in r]
        for name in ("serial", "tp2", "pp2")
    }
    assert [r["step"] for r in serial if "valid_loss" in r] == [3, 6]
    for name in ("tp2", "pp2"):
        assert valid[name] == pytest.approx(valid["serial"], rel=1e-5), name
    # validating (eval mode, no dropout) leaves the training trajectory untouched, dropout on
    assert [r["loss"] for r in read_metrics(tmp_path / "dropout")] == [
        r["loss"] for r in read_metrics(tmp_path / "dropout-no-valid")
    ]
    best = tmp_path / "serial" / "checkpoints" / "best"
    meta = json.loads((best / "meta.json").read_text())
    assert meta["validation"]["step"] == 6 == meta["step"] and meta["validation"]["valid_loss"] == valid["serial"][1]
    reference, step = independent_valid_loss(best, bpe_tokenizer, valid_tsv)
    assert step == 6 and reference == pytest.approx(valid["serial"][1], rel=1e-5)
    assert not (tmp_path / "serial" / "checkpoints" / "latest").exists()  # best/ is outside the rotation


def test_the_valid_bleu_checkpoint_holds_the_weights_only(multi30k_tsv, bpe_tokenizer, valid_tsv, tmp_path):
    """Where the engine's module is not the whole model (TP, PP, ZeRO-3) the BLEU model comes from a temporary
    checkpoint of the step: it holds the fp32 weights only — no AdamW moments, no RNG files (a third of a training
    checkpoint's bytes). ZeRO-3 on one process takes that path; DSR_CRASH_AT=save:2 kills the run in the middle of
    step 2's first save, the validation's, and leaves its files to read."""
    import subprocess

    from tests.launch import REPO_ROOT, env, launch_cmd
    from training.checkpoint.shard_io import read_header

    out = tmp_path / "zero3-bleu"
    args = train_flags(
        multi30k_tsv,
        bpe_tokenizer,
        out,
        "--steps",
        2,
        "--zero_stage",
        3,
        "--valid_file",
        valid_tsv,
        "--valid_interval",
        2,
        "--valid_bleu",
        1,
    )
    proc = subprocess.run(
        launch_cmd(1) + [str(a) for a in args],
        cwd=REPO_ROOT,
        env=dict(env(), DSR_CRASH_AT="save:2"),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode != 0
    partial = out / "checkpoints" / ".valid_bleu.tmp"
    files = sorted(p.name for p in partial.iterdir())
    assert files == ["shard_pp0_tp0.safetensors", "shard_pp0_tp0.safetensors.sha256"], files
    names, _ = read_header(str(partial / files[0]))
    assert names and all(n.startswith("param/") for n in names), sorted(names)[:5]


@pytest.mark.slow
def test_early_stop_when_validation_stops_improving(multi30k_tsv, bpe_tokenizer, valid_tsv, tmp_path):
    # lr 0: the weights never change, so no validation after the first beats it
    proc = run_train(
        1,
        train_flags(
            multi30k_tsv,
            bpe_tokenizer,
            tmp_path,
            "--steps",
            12,
            "--lr",
            0,
            "--valid_file",
            valid_tsv,
            "--valid_interval",
            2,
            "--early_stop_patience",
            2,
            "--save_checkpoint_steps",
            4,
        ),
    )
    assert "early stop after step 6: valid_loss has not improved for 2 validations" in proc.stdout
    # every validation is on the console, also at steps that are not a multiple of --log_interval (5)
    lines = [line for line in proc.stdout.splitlines() if ", valid loss: " in line]
    assert [line.split(",")[0] for line in lines] == ["epoch: 1 step: 2", "epoch: 1 step: 4", "epoch: 1 step: 6"]
    assert all("(best " in line and "at step 2)" in line for line in lines), lines
    assert [r["step"] for r in read_metrics(tmp_path)][-1] == 6
    assert json.loads((tmp_path / "checkpoints" / "best" / "meta.json").read_text())["validation"]["step"] == 2
    # saved every 4 steps and at the step the run stopped early (6)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006"]


@pytest.mark.parametrize(
    "content,needle",
    [
        (None, "--valid_file {path} not found"),
        ("a sentence without a tab\n", "{path}:1:"),
    ],
)
def test_bad_valid_file(content, needle, multi30k_tsv, bpe_tokenizer, tmp_path, assert_user_error):
    path = tmp_path / "valid.tsv"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "out"
    proc = run_train(1, train_flags(multi30k_tsv, bpe_tokenizer, out, "--steps", 2, "--valid_file", path), check=False)
    assert_user_error(proc, needle.format(path=path))
    assert not (out / "metrics.jsonl").exists()
