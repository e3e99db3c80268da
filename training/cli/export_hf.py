"""Export a trained checkpoint and its tokenizer as a `transformers` model folder.

    dstr-export-hf --ckpt_file out/quickstart --output out/quickstart/hf

The folder loads with no code of this repository (transformers 5 has no translation pipeline; these are the lines):

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained("out/quickstart/hf")
    model = AutoModelForSeq2SeqLM.from_pretrained("out/quickstart/hf")
    batch = tok(["Un homme en vélo."], padding=True, truncation=True, return_tensors="pt")
    print(tok.batch_decode(model.generate(**batch), skip_special_tokens=True))

truncation=True matters: the model has src_len source positions, and transformers 5 turns the tokenizer's own limit
(model_max_length = src_len, and the truncation tokenizer.json carries, which the `tokenizers` library applies by
itself) off unless the call asks for it; a longer source then fails inside generate() (IndexError).

It is a BlenderbotForConditionalGeneration (the same pre-LN encoder-decoder; model/hf_export.py lists the
correspondence) in fp32 safetensors, a PreTrainedTokenizerFast that appends EOS as the training data does, and a
generation_config.json that decodes as evaluate.py does: --beam N and --lenpen (default 5 and 1.0; num_beams=1 is
greedy), at most tgt_len tokens, PAD never generated. --ckpt_file is anything evaluate.py takes (a checkpoint of any
layout, a run's output_dir, a merged or averaged .pt), and the tokenizer the one it recorded (--tokenizer only for
checkpoints saved before checkpoints held it). An --output folder that is not empty needs --overwrite.
"""

from __future__ import annotations

import argparse
import os

from common.errors import UserError, console_script
from training.evaluation.decode_cli import add_checkpoint_flags, load_translator


def refuse_inputs_inside(output: str, args) -> None:
    """--overwrite replaces the whole --output folder: what the export reads must not lie in it (a merged .pt or a
    tokenizer kept in an earlier export's folder, or the folder being a run's), or the replacement deletes it."""
    folder = os.path.realpath(output)
    for flag, given in (("--ckpt_file", args.ckpt_file), ("--tokenizer", args.tokenizer)):
        where = os.path.realpath(given) if given else None
        if where is not None and (where == folder or where.startswith(folder + os.sep)):
            raise UserError(
                f"--output {output} holds {flag} {given}: replacing the folder would delete it; write "
                f"the export to another folder"
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="dstr-export-hf",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_checkpoint_flags(p)
    p.add_argument("--output", required=True, help="the folder to write (created; must be empty or new)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model folder at --output")
    p.add_argument("--beam", type=int, default=5, help="generate()'s default num_beams (default 5; 1 = greedy)")
    p.add_argument("--lenpen", type=float, default=1.0, help="generate()'s default length_penalty (default 1.0)")
    args = p.parse_args(argv)
    if args.beam < 1:
        raise UserError(f"--beam {args.beam} must be >= 1 (1 = greedy)")
    output = os.path.abspath(args.output)
    if os.path.isdir(output) and os.listdir(output) and not args.overwrite:  # fail before loading anything
        raise UserError(f"--output {output} is not empty; pass --overwrite to replace it, or choose a new folder")
    if os.path.isdir(output):
        refuse_inputs_inside(output, args)

    args.device = "cpu"  # the export is written from CPU tensors
    translator = load_translator(args)
    path = translator.export_transformers(output, args.overwrite, args.beam, args.lenpen)
    cfg = translator.cfg
    print(
        f"wrote {path}: BlenderbotForConditionalGeneration (d_model {cfg.d_model}, {cfg.encoder_layers}+"
        f"{cfg.decoder_layers} layers, vocab {cfg.vocab_size}, shared embeddings {cfg.share_embeddings}) from "
        f"{translator.checkpoint} (step {translator.step}{translator.chosen}), tokenizer "
        f"{translator.tokenizer_path}; "
        f"generate() defaults: num_beams {args.beam}, length_penalty {args.lenpen}, max_new_tokens {cfg.tgt_len}"
    )
    return 0


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
