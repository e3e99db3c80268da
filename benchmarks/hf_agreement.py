#!/usr/bin/env python3
"""How exactly an exported model reproduces ours: export a checkpoint (run_scripts/export_hf.py's library path),
load it with transformers' Auto classes, and compare on a source file — the encodings, the teacher-forced logits
(max |difference|), greedy `generate(num_beams=1)` and beam `generate(num_beams=N)` against our decoding, sentence by
sentence — plus decode speed of ours with and without the KV cache. A measurement, not a test (tests/test_hf_export.py
holds the tested claims).

    python -m benchmarks.hf_agreement --ckpt_file out/quickstart --tokenizer out/data/bpe8k/tokenizer.json \\
        --src data/multi30k/val.fr.gz --beam 5
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from common.errors import run_cli


def _strip(rows, eos: int, pad: int) -> list[list[int]]:
    return [r[: r.index(eos) + 1] if eos in r else [t for t in r if t != pad] for r in rows.tolist()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_file", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lenpen", type=float, default=1.0)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from common.text_lines import read_lines
    from preprocess.tokenizer import encode_sources
    from training.evaluation.translator import Translator

    lines = read_lines(args.src)[: args.limit]
    ours = Translator.load(args.ckpt_file, args.tokenizer, device="cpu")
    ids = ours.ids
    report = {"sentences": len(lines), "beam": args.beam, "lenpen": args.lenpen}
    for cache in (True, False):
        for beam in (1, args.beam):
            t = ours.translate(lines, beam, args.lenpen, args.batch_size, use_cache=cache)
            report[f"ours_beam{beam}_{'cache' if cache else 'nocache'}_sent_per_s"] = round(len(lines) / t.seconds, 2)
    with tempfile.TemporaryDirectory() as tmp:
        ours.export_transformers(os.path.join(tmp, "hf"), beam=args.beam, length_penalty=args.lenpen)
        tok = AutoTokenizer.from_pretrained(os.path.join(tmp, "hf"))
        hf = AutoModelForSeq2SeqLM.from_pretrained(os.path.join(tmp, "hf"))
    agree = {"encodings": 0, "greedy": 0, "beam": 0, "greedy_text": 0, "beam_text": 0}
    max_diff, hf_seconds = 0.0, {1: 0.0, args.beam: 0.0}
    for lo in range(0, len(lines), args.batch_size):
        chunk = lines[lo : lo + args.batch_size]
        batch = tok(chunk, padding=True, truncation=True, return_tensors="pt")
        rows, _ = encode_sources(ours.tokenizer, chunk, ours.cfg.src_len, ids.eos)
        agree["encodings"] += sum(a == b for a, b in zip(tok(chunk, truncation=True)["input_ids"], rows))
        for beam, key in ((1, "greedy"), (args.beam, "beam")):
            start = time.perf_counter()
            with torch.no_grad():
                theirs = hf.generate(**batch, num_beams=beam, length_penalty=args.lenpen, early_stopping=beam > 1)
            hf_seconds[beam] += time.perf_counter() - start
            mine = ours.decode_ids(batch["input_ids"], beam, args.lenpen)
            agree[key] += sum(
                a == b for a, b in zip(_strip(theirs[:, 1:], ids.eos, ids.pad), _strip(mine, ids.eos, ids.pad))
            )
            agree[key + "_text"] += sum(
                a == b
                for a, b in zip(
                    tok.batch_decode(theirs, skip_special_tokens=True),
                    ours.translate(chunk, beam, args.lenpen).hypotheses,
                )
            )
            if beam == 1:  # teacher-forced logits on our greedy outputs
                tgt = torch.cat([torch.full((len(chunk), 1), ids.bos), mine[:, :-1]], dim=1)
                with torch.no_grad():
                    x = (batch["input_ids"], tgt)
                    for block in ours.model.blocks[:-1]:
                        x = block(x)
                    logits = ours.model.blocks[-1](x if isinstance(x, torch.Tensor) else x[0])
                    hf_logits = hf(
                        **batch, decoder_input_ids=tgt, decoder_attention_mask=(tgt != ids.pad).long()
                    ).logits
                keep = tgt != ids.pad
                max_diff = max(max_diff, (logits[keep] - hf_logits[keep]).abs().max().item())
    report.update(
        {f"identical_{k}": v for k, v in agree.items()},
        max_abs_logit_diff=max_diff,
        hf_greedy_sent_per_s=round(len(lines) / hf_seconds[1], 2),
        hf_beam_sent_per_s=round(len(lines) / hf_seconds[args.beam], 2),
    )
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
