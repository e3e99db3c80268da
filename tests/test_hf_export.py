"""Export to transformers (model/hf_export.py, run_scripts/export_hf.py): the folder loads with AutoModelForSeq2SeqLM /
AutoTokenizer and computes what our model computes.

- a random model (separate and shared tables) saved as Blenderbot and loaded back with from_pretrained: teacher-forced
  logits equal ours (<= 1e-5 relative), generate(num_beams=1) equals our greedy search and generate(num_beams=5,
  length_penalty=0.6/1.0/2.0) our beam search, token for token, on 48 real Multi30k val sentences. A random model is
  the stronger test here: its sharp, varied distributions (init_std 0.3, the EOS row of the projection scaled so
  hypotheses end anywhere from 2 to 16 tokens) make beam search differ from greedy on nearly every sentence, which
  a model trained a few steps (near-uniform, repetitive output) would not;
- end to end on a checkpoint trained 20 steps with shared embeddings: export_hf.py (the tokenizer found through the
  checkpoint) → AutoTokenizer encodes every sentence as the training data does (tokens, EOS; truncation=True cuts as
  the dataset does) and decodes as we do; generate() with the exported defaults (beam 5) and with num_beams=1 gives
  evaluate's translations; the exported tokenizer.json truncates to the model's positions by itself, and README's
  transformers-5 lines translate a source longer than the positions as we do;
- bad input (non-empty --output, --beam 0, another tokenizer): one `error:` line, nothing written.
"""

import gzip
import sys

import pytest
import torch

from model.config import ModelConfig
from model.hf_export import to_blenderbot
from model.inference import beam_decode, greedy_decode
from model.transformer import Seq2SeqTransformer
from tests.launch import REPO_ROOT, TINY, concurrently, env, run_python, run_train

EXPORT = str(REPO_ROOT / "run_scripts" / "export_hf.py")
SRC_LEN = TGT_LEN = 16


def val_lines(multi30k_dir, n: int, lang: str = "fr") -> list[str]:
    with gzip.open(multi30k_dir / f"val.{lang}.gz", "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


def strip(rows, eos: int, pad: int) -> list[list[int]]:
    """Generated rows up to and including the first EOS, or without the trailing PAD."""
    out = []
    for row in rows.tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else [t for t in row if t != pad])
    return out


def teacher_forced(model, src, tgt) -> torch.Tensor:
    x = (src, tgt)
    for block in model.blocks[:-1]:
        x = block(x)
    return model.blocks[-1](x if isinstance(x, torch.Tensor) else x[0])


@pytest.fixture(scope="module")
def val_batch(multi30k_dir, bpe_tokenizer):
    from preprocess.tokenizer import encode_sources, load_tokenizer, special_ids

    tok = load_tokenizer(bpe_tokenizer)
    ids = special_ids(tok)
    rows, _ = encode_sources(tok, val_lines(multi30k_dir, 48), SRC_LEN, ids.eos)
    src = torch.full((len(rows), max(map(len, rows))), ids.pad)
    for i, r in enumerate(rows):
        src[i, : len(r)] = torch.tensor(r)
    return src, ids


@pytest.mark.parametrize("share", [False, True])
def test_blenderbot_computes_what_our_model_computes(share, val_batch, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    src, ids = val_batch
    cfg = ModelConfig(
        vocab_size=8000,
        d_model=32,
        num_heads=4,
        ffn_size=64,
        encoder_layers=2,
        decoder_layers=2,
        src_len=SRC_LEN,
        tgt_len=TGT_LEN,
        init_std=0.3,
        share_embeddings=share,
    )
    model = Seq2SeqTransformer(cfg, seed=1)
    with torch.no_grad():
        table = model.blocks[0].word if share else model.blocks[-1].proj
        table.weight[ids.eos] *= 8  # hypotheses end at every length
    to_blenderbot(model, ids.bos, ids.eos, ids.pad).save_pretrained(tmp_path / "hf")
    hf = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "BlenderbotForConditionalGeneration" and not hf.training
    mask = (src != ids.pad).long()

    greedy = greedy_decode(model, src, ids.bos, ids.eos, TGT_LEN)
    tgt = torch.cat([torch.full((len(src), 1), ids.bos), greedy[:, :-1]], dim=1)  # teacher-force our outputs
    model.eval()
    with torch.no_grad():
        ours = teacher_forced(model, src, tgt)
        theirs = hf(
            input_ids=src,
            attention_mask=mask,
            decoder_input_ids=tgt,  # PAD after EOS: masked keys
            decoder_attention_mask=(tgt != ids.pad).long(),
        ).logits
    real = tgt != ids.pad  # positions after EOS are PAD: never a loss or a decoding step of ours, and
    ours, theirs = ours[real], theirs[real]  # not computed (model/packing.py); every real position must agree
    assert (ours - theirs).abs().max().item() <= 1e-5 * ours.abs().max().item()

    hf_greedy = hf.generate(input_ids=src, attention_mask=mask, num_beams=1)
    assert strip(hf_greedy[:, 1:], ids.eos, ids.pad) == strip(greedy, ids.eos, ids.pad)
    ended = 0
    for lenpen in (0.6, 1.0, 2.0):
        beam = beam_decode(model, src, ids.bos, ids.eos, TGT_LEN, beam=5, length_penalty=lenpen)
        hf_beam = hf.generate(input_ids=src, attention_mask=mask, num_beams=5, length_penalty=lenpen)
        assert strip(hf_beam[:, 1:], ids.eos, ids.pad) == strip(beam, ids.eos, ids.pad), lenpen
        assert (beam != greedy[:, : beam.shape[1]]).any(1).sum() > len(src) // 2  # beam search is not greedy here
        ended += int((beam == ids.eos).any(1).sum())
    assert ended > len(src)  # many hypotheses ended with EOS, at various lengths


def test_exported_word_tokenizer_encodes_and_decodes_as_ours(multi30k_tsv, multi30k_dir, tmp_path):
    """The seed's `word` vocabulary (lowercasing, <eot> both begins and ends) exports as faithfully as BPE."""
    from transformers import AutoTokenizer

    from preprocess.tokenizer import (
        decode_hypotheses,
        encode_sources,
        load_tokenizer,
        save_for_transformers,
        special_ids,
        train_tokenizer,
    )

    path = train_tokenizer([multi30k_tsv], tmp_path / "word", type="word", vocab_size=3000)
    save_for_transformers(path, tmp_path / "hf", SRC_LEN)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = special_ids(ours)
    assert ids.bos == ids.eos == theirs.eos_token_id and theirs.pad_token_id == ids.pad
    lines = val_lines(multi30k_dir, 40)
    rows, cut = encode_sources(ours, lines, SRC_LEN, ids.eos)
    assert cut and theirs(lines, truncation=True)["input_ids"] == rows
    assert theirs.batch_decode(rows, skip_special_tokens=True) == decode_hypotheses(ours, rows, ids.eos, ids.pad)[0]


# ------------------------------------------------------------------------------------------------ export_hf.py
@pytest.fixture(scope="module")
def trained_shared(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("export-run")
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
            "--share_embeddings",
            1,
            "--steps",
            20,
            "--save_checkpoint_steps",
            20,
        ],
    )
    return out


def export(*args):
    return run_python([sys.executable, EXPORT, *map(str, args)], env=env())


def test_export_cli_loads_in_transformers_and_translates_as_we_do(
    trained_shared, bpe_tokenizer, multi30k_dir, tmp_path
):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from preprocess.tokenizer import encode_sources
    from training.evaluation.translator import Translator

    out = tmp_path / "hf"
    proc = export("--ckpt_file", trained_shared, "--output", out)  # the tokenizer: the checkpoint's own
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert hf.config.tie_word_embeddings and hf.generation_config.num_beams == 5

    ours = Translator.load(str(trained_shared), str(bpe_tokenizer), device="cpu")
    lines = val_lines(multi30k_dir, 40)
    rows, cut = encode_sources(ours.tokenizer, lines, ours.cfg.src_len, ours.ids.eos)
    assert cut  # src_len 12: some sentences are cut
    assert tok(lines, truncation=True)["input_ids"] == rows
    assert tok(lines[:1])["input_ids"][0][-1] == ours.ids.eos

    batch = tok(lines, padding=True, truncation=True, return_tensors="pt")
    for beam, kwargs in ((5, {}), (1, {"num_beams": 1})):  # the exported default, then greedy
        hf_out = hf.generate(**batch, **kwargs)
        src = batch["input_ids"]
        assert strip(hf_out[:, 1:], ours.ids.eos, ours.ids.pad) == strip(
            ours.decode_ids(src, beam=beam), ours.ids.eos, ours.ids.pad
        ), beam
        assert tok.batch_decode(hf_out, skip_special_tokens=True) == ours.translate(lines, beam=beam).hypotheses

    # a source longer than the model's positions: the tokenizers library truncates with the exported file by itself,
    # and README's lines for transformers 5 (truncation=True) translate it as we do instead of failing in generate()
    from tokenizers import Tokenizer

    long = " ".join(lines[:4])
    (long_row,), _ = encode_sources(ours.tokenizer, [long], ours.cfg.src_len, ours.ids.eos)
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(long).ids == long_row
    assert tok.model_max_length == ours.cfg.src_len
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    snippet = next(block for block in readme.split("```python\n")[1:] if "AutoModelForSeq2SeqLM" in block)
    snippet = snippet.split("```")[0].replace("out/quickstart/hf", str(out))
    assert "truncation=True" in snippet and "sentences = [" in snippet
    printed = []
    namespace = {"print": printed.append}
    exec(snippet.replace("sentences = [", f"sentences = [{long!r}, "), namespace)  # the README's own
    assert printed[0][0] == ours.translate([long], beam=5).hypotheses[0]

    proc = export(
        "--ckpt_file", trained_shared, "--tokenizer", bpe_tokenizer, "--output", out, "--overwrite", "--beam", 1
    )  # a previous export is replaced
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert AutoModelForSeq2SeqLM.from_pretrained(out).generation_config.num_beams == 1


def test_export_errors_are_one_line_and_write_nothing(
    trained_shared, bpe_tokenizer, multi30k_tsv, tmp_path, assert_user_error
):
    from preprocess.tokenizer import train_tokenizer

    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    fresh = tmp_path / "fresh"
    other = train_tokenizer([multi30k_tsv], tmp_path / "bpe4k", vocab_size=4000)
    cases = [  # (export_hf.py arguments, what its one error line must say); none may write anything
        (
            ("--ckpt_file", trained_shared, "--tokenizer", bpe_tokenizer, "--output", out),
            ("is not empty", "--overwrite"),
        ),
        (
            ("--ckpt_file", trained_shared, "--tokenizer", bpe_tokenizer, "--output", out, "--overwrite"),
            ("holds no model",),
        ),
        (("--ckpt_file", trained_shared, "--tokenizer", bpe_tokenizer, "--output", fresh, "--beam", 0), ("--beam 0",)),
        (("--ckpt_file", trained_shared, "--tokenizer", other, "--output", fresh), ("sha256 differs",)),
    ]
    results = concurrently(*[lambda a=argv: export(*a) for argv, _ in cases])
    for (_, needles), result in zip(cases, results, strict=True):
        assert_user_error(result, *needles)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert not fresh.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bpe4k", "hf"]


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_exported_folder_has_the_modes_save_pretrained_gives_under_the_umask(trained_shared, tmp_path, mask):
    """Not the 0700 folder of the tempfile.mkdtemp it is staged in, nor safetensors' 0600 model file: 0777 / 0666
    less the umask, as a folder and files created in place are (0755 / 0644 under the usual 022)."""
    import os

    from training.evaluation.translator import Translator

    translator = Translator.load(str(trained_shared), device="cpu")
    old = os.umask(mask)
    try:
        out = translator.export_transformers(str(tmp_path / "hf"))
    finally:
        os.umask(old)
    files = sorted(os.listdir(out))
    assert "model.safetensors" in files and "config.json" in files
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~mask)
    assert {name: oct(os.stat(os.path.join(out, name)).st_mode & 0o777) for name in files} == {
        name: oct(0o666 & ~mask) for name in files
    }
