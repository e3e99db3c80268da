"""Greedy decoding (model/inference.py) and the BLEU evaluation script (run_scripts/evaluate.py).

- greedy_decode stops each row at EOS (PAD after it), respects max_len, and is independent of batching;
- every greedy token is the argmax of an independent, unbatched teacher-forced forward on the decoded prefix;
- evaluate.py on a checkpoint trained for 3 steps: rc 0, a `BLEU = ` line, and the BLEU equals sacrebleu.corpus_bleu
  recomputed here from its --output hypotheses, greedy and with --beam; --no_cache gives the same hypotheses; sources
  longer than src_len are counted (the count recomputed here), warned about and reported in the JSON summary;
  user mistakes give one `error:` line and write nothing;
- translate.py with only --ckpt_file (the checkpoint holds its tokenizer; an averaged .pt its text): stdin or a file
  → the Translator's translations, one per line, empty lines kept; evaluate.py without --tokenizer and --ref; a
  checkpoint from before tokenizers were recorded asks for --tokenizer in one line.
"""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.inference import greedy_decode
from model.transformer import Seq2SeqTransformer
from tests.launch import REPO_ROOT, TINY, concurrently, env, run_python, run_train
from tests.progress import scaled

PAD, UNK, BOS, EOS = 0, 1, 2, 3
B, S, T, V = 6, 7, 8, 12
EVALUATE = str(REPO_ROOT / "run_scripts" / "evaluate.py")


def tiny_model(seed: int) -> Seq2SeqTransformer:
    # init_std 0.5: well-separated logits, so the argmax is not decided by rounding; dropout on, to check eval mode
    cfg = ModelConfig(
        vocab_size=V,
        d_model=16,
        num_heads=4,
        ffn_size=24,
        encoder_layers=2,
        decoder_layers=2,
        src_len=S,
        tgt_len=T,
        dropout=0.1,
        attention_dropout=0.1,
        init_std=0.5,
        pad_id=PAD,
    )
    return Seq2SeqTransformer(cfg, seed=seed).double()


def sources(seed: int) -> torch.Tensor:
    """Dataset layout: tokens, EOS, PAD — rows of different lengths."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((B, S), PAD)
    for i in range(B):
        n = 1 + i % (S - 1)
        src[i, :n] = torch.randint(4, V, (n,), generator=g)
        src[i, n] = EOS
    return src


def first_eos(row: list) -> int:
    """Tokens up to and including the first EOS (the whole row if none)."""
    return row.index(EOS) + 1 if EOS in row else len(row)


def test_stops_at_eos_per_row_and_is_batch_independent():
    mixed = None
    for seed in range(30):  # a random model where some rows stop early, some don't
        model = tiny_model(seed)
        out = greedy_decode(model, sources(seed), BOS, EOS, T)
        ended = [EOS in row for row in out.tolist()]
        if any(ended) and not all(ended):
            mixed = seed, model, out
            break
    assert mixed, "no seed gave a batch with both finished and unfinished rows"
    seed, model, out = mixed
    assert model.training  # the caller's mode is restored
    assert out.dtype == torch.long and out.shape[0] == B and out.shape[1] == T  # an unfinished row runs to max_len
    for row in out.tolist():
        n = first_eos(row)
        assert PAD not in row[:n]  # PAD is never generated
        assert all(t == PAD for t in row[n:])  # nothing after EOS
    src = sources(seed)
    for i in range(B):  # alone in its batch: the same tokens
        alone = greedy_decode(model, src[i : i + 1], BOS, EOS, T)[0].tolist()
        assert alone == out[i].tolist()[: len(alone)] and all(t == PAD for t in out[i].tolist()[len(alone) :])


def test_all_rows_finished_stops_early_and_max_len_is_respected():
    model = tiny_model(0)
    head = model.blocks[-1]
    with torch.no_grad():  # LayerNorm output ≡ its bias; the head maps it to logits
        head.ln.weight.zero_()
        head.ln.bias.copy_(torch.linspace(-1, 1, 16, dtype=torch.float64))
        head.proj.weight.zero_()
        head.proj.weight[EOS] = 10 * head.ln.bias
    out = greedy_decode(model, sources(0), BOS, EOS, T)
    assert out.tolist() == [[EOS]] * B  # every row ends at once: the loop stops after 1 step
    with torch.no_grad():
        head.proj.weight[EOS] = -10 * head.ln.bias  # EOS never wins: rows run to max_len
        head.proj.weight[5] = 5 * head.ln.bias
    for max_len in (1, 3, T):
        out = greedy_decode(model, sources(0), BOS, EOS, max_len)
        assert out.shape == (B, max_len) and bool((out == 5).all())
    with pytest.raises(ValueError, match="max_len"):
        greedy_decode(model, sources(0), BOS, EOS, T + 1)
    out = greedy_decode(model, sources(0), BOS, EOS, T, vocab_limit=5)  # ids >= 5 may not be generated
    assert bool((out < 5).all()) and bool((out != PAD).all())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_greedy_tokens_are_the_teacher_forced_argmax(seed):
    model = tiny_model(seed)
    src = sources(seed)
    out = greedy_decode(model, src, BOS, EOS, T).tolist()
    model.eval()
    with torch.no_grad():
        for i, row in enumerate(out):
            y = row[: first_eos(row)]
            prefix = torch.tensor([[BOS] + y[:-1]])  # unbatched and unpadded: nothing shared with decoding
            logits = model.logits(src[i : i + 1], prefix)[0]  # [len(y), V], one full teacher-forced pass
            logits[:, PAD] = float("-inf")
            assert logits.argmax(-1).tolist() == y, f"row {i}"


# --------------------------------------------------------------------------------------------- evaluate.py
@pytest.fixture(scope="module")
def trained(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-run")
    run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            3,
            "--save_checkpoint_steps",
            3,
        ],
    )
    return out


@pytest.fixture(scope="module")
def val50(multi30k_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("val50")
    for lang in ("fr", "en"):
        with gzip.open(multi30k_dir / f"val.{lang}.gz", "rt", encoding="utf-8") as f:
            lines = [next(f) for _ in range(50)]
        (d / f"val50.{lang}").write_text("".join(lines), encoding="utf-8")
    return d / "val50.fr", d / "val50.en"


def evaluate(*args):
    return run_python([sys.executable, EVALUATE, *map(str, args)], env=env())


def long_sources(tokenizer_path, lines, src_len) -> int:
    """Sources with more tokens than the model's src_len-1 (+ EOS) positions, counted here with tokenizers."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    return sum(len(e.ids) > src_len - 1 for e in tok.encode_batch(lines, add_special_tokens=False))


def test_evaluate_end_to_end_bleu_matches_sacrebleu(trained, bpe_tokenizer, val50, tmp_path):
    import sacrebleu

    src, ref = val50
    refs = ref.read_text(encoding="utf-8").splitlines()
    n_long = long_sources(bpe_tokenizer, src.read_text(encoding="utf-8").splitlines(), 12)  # TINY: src_len 12
    assert 0 < n_long < 50
    outputs = {}
    for name, flags in (("greedy", []), ("greedy-uncached", ["--no_cache"]), ("beam", ["--beam", 4, "--lenpen", 0.8])):
        hyp_file = tmp_path / "hyps" / f"val50.{name}.en"
        proc = evaluate(
            "--ckpt_file",
            trained,
            "--tokenizer",
            bpe_tokenizer,
            "--src",
            src,
            "--ref",
            ref,
            "--batch_size",
            16,
            "--output",
            hyp_file,
            "--no_progress",
            *flags,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        bleu_line = next(row for row in lines if row.startswith("BLEU = "))
        summary = json.loads(lines[-1])
        hyps = hyp_file.read_text(encoding="utf-8").split("\n")
        assert hyps[-1] == "" and len(hyps) == 51  # 50 lines, each ending in a newline
        expected = sacrebleu.corpus_bleu(hyps[:-1], [refs])
        assert bleu_line == str(expected)
        assert summary["bleu"] == pytest.approx(expected.score, abs=1e-4)
        assert summary["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps[:-1], [refs]).score, abs=1e-4)
        assert summary["sentences"] == 50 and summary["seconds"] > 0 and summary["step"] == 3
        assert summary["sentences_per_second"] > 0 and summary["kv_cache"] == (name != "greedy-uncached")
        assert summary["beam"] == (4 if name == "beam" else 1)
        assert "nrefs:1|case:mixed" in proc.stdout  # the signature is printed
        assert summary["truncated_sources"] == n_long  # counted, and said on stderr
        assert f"warning: {n_long} of 50 sources have more than src_len-1 = 11 tokens" in proc.stderr
        outputs[name] = hyps
    assert outputs["greedy"] == outputs["greedy-uncached"]


def test_evaluate_errors_are_one_line(trained, bpe_tokenizer, multi30k_tsv, val50, tmp_path, assert_user_error):
    from tokenizers import Tokenizer

    from preprocess.tokenizer import train_tokenizer

    src, ref = val50
    short = tmp_path / "short.en"
    short.write_text("".join(ref.read_text(encoding="utf-8").splitlines(keepends=True)[:49]), encoding="utf-8")
    bigger = Tokenizer.from_file(str(bpe_tokenizer))
    bigger.add_tokens([f"extra{i}" for i in range(10)])
    bigger.save(str(tmp_path / "bigger.json"))
    other = train_tokenizer([multi30k_tsv], tmp_path / "bpe4k", vocab_size=4000)
    out = tmp_path / "hyp.en"
    cases = [  # (evaluate.py arguments, what its one error line must say)
        (
            ("--ckpt_file", trained, "--tokenizer", bpe_tokenizer, "--src", src, "--ref", short),
            ("has 50 lines", "has 49"),
        ),
        (("--ckpt_file", tmp_path / "nope", "--tokenizer", bpe_tokenizer, "--src", src, "--ref", ref), ("not found",)),
        (
            ("--ckpt_file", trained, "--tokenizer", tmp_path / "none.json", "--src", src, "--ref", ref),
            ("tokenizer file not found",),
        ),
        (
            ("--ckpt_file", trained, "--tokenizer", bpe_tokenizer, "--src", tmp_path / "x.fr", "--ref", ref),
            ("file not found",),
        ),
        (
            ("--ckpt_file", trained, "--tokenizer", tmp_path / "bigger.json", "--src", src, "--ref", ref),
            ("8010 tokens", "vocab_size 8000"),
        ),
        (
            ("--ckpt_file", trained, "--tokenizer", other, "--src", src, "--ref", ref, "--output", out),
            ("sha256 differs",),
        ),
        (
            (
                "--ckpt_file",
                trained,
                "--tokenizer",
                bpe_tokenizer,
                "--src",
                src,
                "--ref",
                ref,
                "--beam",
                0,
                "--output",
                out,
            ),
            ("--beam 0",),
        ),
    ]
    results = concurrently(*[lambda a=argv: evaluate(*a) for argv, _ in cases])
    for (_, needles), result in zip(cases, results):
        assert_user_error(result, *needles)
    assert not out.exists()


# --------------------------------------------------------------------------------------------- translate.py
TRANSLATE = str(REPO_ROOT / "run_scripts" / "translate.py")


def translate(*args, stdin=None):
    if stdin is None:
        return run_python([sys.executable, TRANSLATE, *map(str, args)], env=env())
    return subprocess.run(
        [sys.executable, TRANSLATE, *map(str, args)],
        input=stdin,
        env=env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )


DECODING_VALUES = [  # (script, flags, the start of its one error line)
    ("translate", ["--beam", "3", "--lenpen", "nan"], "error: --lenpen nan must be a finite number in [0, 5]"),
    ("translate", ["--beam", "3", "--lenpen", "-1e30"], "error: --lenpen -1e30 must be in [0, 5]"),
    ("translate", ["--beam", "3", "--lenpen=inf"], "error: --lenpen inf must be a finite number in [0, 5]"),
    ("translate", ["--beam", "3", "--lenpen", "-1"], "error: --lenpen -1 must be in [0, 5]"),
    ("translate", ["--beam", "3", "--lenpen", "6"], "error: --lenpen 6 must be in [0, 5]"),
    ("translate", ["--beam", "0"], "error: --beam 0 must be >= 1 (1 = greedy)"),
    ("translate", ["--batch_size", "-4"], "error: --batch_size -4 must be >= 1"),
    ("evaluate", ["--beam", "2", "--lenpen", "nan"], "error: --lenpen nan must be a finite number in [0, 5]"),
    ("evaluate", ["--limit", "0"], "error: --limit 0 must be >= 1"),
]


@pytest.mark.parametrize(
    "script,flags,start", DECODING_VALUES, ids=[f"{s} {' '.join(f)}" for s, f, _ in DECODING_VALUES]
)
def test_a_decoding_value_the_flag_does_not_accept_is_one_line(script, flags, start, trained, val50, tmp_path):
    """Each would decode (a real checkpoint and input): NaN made every beam score NaN, -1e30 every translation
    empty, exit 0. Refused while the flags are parsed, nothing written."""
    src, ref = val50
    out = tmp_path / "out.txt"
    if script == "translate":
        proc = translate("--ckpt_file", trained, "--input", src, "--output", out, *flags)
    else:
        proc = evaluate("--ckpt_file", trained, "--src", src, "--ref", ref, "--output", out, *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), proc.stderr[-3000:]
    assert not out.exists()


def test_translate_needs_only_the_checkpoint(trained, bpe_tokenizer, val50, tmp_path, assert_user_error):
    """A checkpoint holds its tokenizer (a copy of tokenizer.json, and merged/averaged .pt files its text), so
    translate.py needs nothing but --ckpt_file: stdin or a file in, one translation per line out (stdout holds only
    them), the same translations as the Translator given the tokenizer explicitly, greedy and beam; evaluate.py needs
    neither --tokenizer nor --ref; a checkpoint from before checkpoints held their tokenizer asks for --tokenizer."""
    from training.checkpoint import consolidated
    from training.checkpoint.folder import resolve
    from training.evaluation.translator import Translator

    src, _ = val50
    sources = src.read_text(encoding="utf-8").splitlines()[:12]
    step = resolve(str(trained))
    assert (Path(step) / "tokenizer.json").read_bytes() == Path(bpe_tokenizer).read_bytes()
    reference = Translator.load(str(trained), str(bpe_tokenizer), device="cpu")
    want = {beam: reference.translate(sources, beam=beam).hypotheses for beam in (1, 3)}

    stdin = "\n".join(sources[:6] + [""] + sources[6:]) + "\n"  # an empty line stays an empty line
    proc = translate("--ckpt_file", trained, stdin=stdin)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == want[1][:6] + [""] + want[1][6:]
    assert f"tokenizer {step} (recorded)" in proc.stderr

    avg = tmp_path / "avg.pt"  # an averaged .pt carries the tokenizer's text
    consolidated.save(consolidated.average([str(trained)]), str(avg))
    (tmp_path / "in.fr").write_text("\n".join(sources) + "\n", encoding="utf-8")
    out = tmp_path / "new" / "folder" / "out.en"  # missing folders are made (it traced back)
    proc = translate("--ckpt_file", avg, "--input", tmp_path / "in.fr", "--beam", 3, "--output", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text(encoding="utf-8").splitlines() == want[3] and proc.stdout == ""
    # the text an averaged .pt carries is checked against the tokenizer's sha256 recorded with it, as a file is
    state = torch.load(avg, weights_only=False)
    state["tokenizer_json"] += "\n"  # the same vocabulary, other bytes: only the sha256 tells
    torch.save(state, tmp_path / "changed.pt")
    assert_user_error(
        translate("--ckpt_file", tmp_path / "changed.pt", "--input", tmp_path / "in.fr"),
        "is not the one checkpoint",
        "sha256 differs",
    )

    proc = evaluate("--ckpt_file", trained, "--src", tmp_path / "in.fr", "--no_progress")  # no --tokenizer, --ref
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert "bleu" not in summary and summary["sentences"] == 12 and "BLEU = " not in proc.stdout

    old = tmp_path / "old"  # a checkpoint saved before this change
    shutil.copytree(step, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["tokenizer"]
    (old / "meta.json").write_text(json.dumps(meta))
    (old / "tokenizer.json").unlink()
    assert_user_error(
        translate("--ckpt_file", old, "--input", tmp_path / "in.fr"), "does not hold its tokenizer", "--tokenizer"
    )
    proc = translate("--ckpt_file", old, "--input", tmp_path / "in.fr", "--tokenizer", bpe_tokenizer)
    assert proc.returncode == 0 and proc.stdout.splitlines() == want[1], proc.stderr[-2000:]
    assert_user_error(translate("--ckpt_file", trained, "--input", tmp_path / "none.fr"), "not found")
