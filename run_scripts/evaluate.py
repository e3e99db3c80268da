#!/usr/bin/env python3
"""Translate a source file with a trained checkpoint (greedy decoding) and score it against references with
sacreBLEU (BLEU and chrF).

    python run_scripts/evaluate.py --ckpt_file out/quickstart --tokenizer out/data/bpe8k/tokenizer.json \\
        --src data/multi30k/val.fr.gz --ref data/multi30k/val.en.gz --output out/quickstart/val.hyp.en

--ckpt_file is a step_* folder, a checkpoints/ folder or a run's output_dir (→ its latest checkpoint), saved under
any parallel layout: it is merged into the serial model (run_scripts/merge_checkpoint.py) and decoded in one
process. Sources are encoded as the training data is (the first src_len-1 tokens, EOS, then PAD), translations are
greedy up to tgt_len tokens and detokenized with the tokenizer's decoder; the --tokenizer must be the one the
checkpoint was trained with. Prints sacreBLEU's `BLEU = ...` and `chrF2 = ...` lines with their signatures, then
one JSON line: {"bleu", "chrf", "sentences", "seconds", ...}. --output writes one hypothesis per line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from preprocess.errors import UserError, run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt_file", required=True, help="a step_* folder, a checkpoints/ folder or a run's output_dir")
    p.add_argument("--tokenizer", required=True, help="the tokenizer.json the checkpoint was trained with (or its "
                                                      "folder)")
    p.add_argument("--src", required=True, help="source sentences, one per line (plain or .gz)")
    p.add_argument("--ref", required=True, help="reference translations, line-aligned with --src (plain or .gz)")
    p.add_argument("--batch_size", type=int, default=64, help="sentences decoded together (default: 64)")
    p.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    p.add_argument("--output", default=None, help="write the hypotheses here, one per line")
    p.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU/chrF (e.g. for the lowercasing "
                                                            "`word` tokenizer)")
    p.add_argument("--ignore_tokenizer_hash", action="store_true",
                   help="decode even if --tokenizer is not byte-identical to the one recorded in the checkpoint")
    p.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def _sha256(path: str) -> str:
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def encode_sources(tokenizer, lines, src_len: int, eos_id: int, pad_id: int):
    """[N, src_len] int64, exactly as preprocess.dataset lays out `src`: tokens[:src_len-1] + [EOS], then PAD."""
    import torch
    encoded = tokenizer.encode_batch(list(lines), add_special_tokens=False)
    out = torch.full((len(encoded), src_len), pad_id, dtype=torch.long)
    for i, enc in enumerate(encoded):
        ids = enc.ids[: src_len - 1]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        out[i, len(ids)] = eos_id
    return out


def strip_after_eos(row, eos_id: int, pad_id: int) -> tuple[list[int], bool]:
    """Token ids before the first EOS (PAD dropped) and whether an EOS was produced."""
    ids = []
    for tok in row:
        if tok == eos_id:
            return ids, True
        if tok != pad_id:
            ids.append(tok)
    return ids, False


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.batch_size < 1:
        raise UserError(f"--batch_size {args.batch_size} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit} must be >= 1")

    from training.checkpoint import read_meta, resolve
    ckpt = resolve(args.ckpt_file)
    meta = read_meta(ckpt)

    from preprocess.tokenizer import TOKENIZER_FILE, load_tokenizer, special_ids
    tok_path = args.tokenizer
    if os.path.isdir(tok_path):
        tok_path = os.path.join(tok_path, TOKENIZER_FILE)
    tokenizer = load_tokenizer(tok_path)
    ids = special_ids(tokenizer)
    tok_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    model_vocab, model_pad = meta["model"]["vocab_size"], meta["model"]["pad_id"]
    if tok_vocab > model_vocab:
        raise UserError(f"tokenizer {tok_path} has {tok_vocab} tokens but checkpoint {ckpt} was trained with "
                        f"vocab_size {model_vocab}: it is not the tokenizer of this checkpoint (pass the "
                        f"--tokenizer the run trained with)")
    if ids.pad != model_pad:
        raise UserError(f"tokenizer {tok_path} has PAD id {ids.pad} but checkpoint {ckpt} was trained with pad_id "
                        f"{model_pad}: it is not the tokenizer of this checkpoint")
    saved_hash = meta.get("tokenizer_sha256")
    if saved_hash and not args.ignore_tokenizer_hash and _sha256(tok_path) != saved_hash:
        raise UserError(f"tokenizer {tok_path} is not the one checkpoint {ckpt} was trained with (sha256 differs); "
                        f"token ids would not match. Pass the run's tokenizer, or --ignore_tokenizer_hash if it "
                        f"is a byte-different copy of the same vocabulary")

    from preprocess.textio import atomic_write, read_lines
    sources, references = read_lines(args.src), read_lines(args.ref)
    if len(sources) != len(references):
        raise UserError(f"--src {args.src} has {len(sources)} lines but --ref {args.ref} has {len(references)}; "
                        f"the files must be line-aligned translations of each other")
    if args.limit is not None:
        sources, references = sources[: args.limit], references[: args.limit]

    from tqdm import tqdm

    from merge_checkpoint import merge
    from model.config import ModelConfig
    from model.generate import greedy_decode
    from model.transformer import Seq2SeqTransformer

    merged = merge(ckpt)
    cfg = ModelConfig(**merged["model_config"])
    model = Seq2SeqTransformer(cfg)
    model.load_state_dict(merged["model"], strict=True)
    model.eval()
    load_seconds = time.perf_counter() - start

    src_ids = encode_sources(tokenizer, sources, cfg.src_len, ids.eos, ids.pad)
    hyp_ids: list[list[int]] = []
    unfinished = 0
    decode_start = time.perf_counter()
    batches = range(0, len(sources), args.batch_size)
    for i in tqdm(batches, desc="decoding", unit="batch", disable=args.no_progress, file=sys.stderr):
        out = greedy_decode(model, src_ids[i: i + args.batch_size], ids.bos, ids.eos, cfg.tgt_len,
                            pad_id=ids.pad, vocab_limit=tok_vocab)
        for row in out.tolist():
            kept, finished = strip_after_eos(row, ids.eos, ids.pad)
            hyp_ids.append(kept)
            unfinished += not finished
    decode_seconds = time.perf_counter() - decode_start
    hyps = [h.replace("\n", " ").strip() for h in tokenizer.decode_batch(hyp_ids, skip_special_tokens=True)]

    from sacrebleu.metrics import BLEU, CHRF
    bleu_metric, chrf_metric = BLEU(lowercase=args.lowercase), CHRF(lowercase=args.lowercase)
    bleu = bleu_metric.corpus_score(hyps, [references])
    chrf = chrf_metric.corpus_score(hyps, [references])

    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with atomic_write(args.output) as handle:
            for h in hyps:
                handle.write(h + "\n")
    seconds = time.perf_counter() - start

    print(f"{bleu}")
    print(f"BLEU signature: {bleu_metric.get_signature()}")
    print(f"{chrf}")
    print(f"chrF signature: {chrf_metric.get_signature()}")
    print(f"checkpoint {ckpt} (step {merged['step']}), {len(hyps)} sentences, {unfinished} reached tgt_len "
          f"{cfg.tgt_len} without EOS; decoding {decode_seconds:.1f} s, total {seconds:.1f} s"
          + (f"; hypotheses in {args.output}" if args.output else ""))
    summary = {"bleu": round(bleu.score, 4), "chrf": round(chrf.score, 4), "sentences": len(hyps),
               "seconds": round(seconds, 3), "decode_seconds": round(decode_seconds, 3),
               "load_seconds": round(load_seconds, 3), "unfinished": unfinished, "step": merged["step"],
               "checkpoint": ckpt, "bleu_signature": str(bleu_metric.get_signature()),
               "chrf_signature": str(chrf_metric.get_signature())}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
