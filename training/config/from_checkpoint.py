"""A run that starts from a checkpoint (--resume, --ckpt_file) takes the checkpoint's settings for what it flags
leave open: the model's configuration, the tokenizer (the copy the checkpoint holds) and the batching flags that fix
the data order (batch_size or max_tokens/batch_multiple/pad_multiple, and the seed).

Before, every model flag had to be repeated on resume — the checkpoint's meta.json holds them all. Now a flag given
on the command line or in the recipe still wins: a setting that may change (dropout, label smoothing) is overridden
and said so; one that would stop the weights from loading (a size: d_model, heads, FFN, layers, lengths, vocabulary,
shared embeddings — or another tokenizer) is refused here, naming the flag, before anything is built.

`inherit(args, explicit)` rewrites the parsed Namespace (training.config.flags.parse_config calls it for train.py) and
returns the lines to print: which settings came from the checkpoint, which flags overrode it.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from common.errors import UserError
from common.hashing import file_sha256

# flag dest → meta.json "model" field; sizes must match for the weights to load, the rest may change
MODEL_FLAGS = {"vocab_size": "vocab_size", "d_model": "d_model", "num_heads": "num_heads", "ffn_size": "ffn_size",
               "encoder_layer": "encoder_layers", "decoder_layer": "decoder_layers", "src_len": "src_len",
               "tgt_len": "tgt_len", "share_embeddings": "share_embeddings", "dropout": "dropout",
               "attention_dropout": "attention_dropout", "label_smoothing": "label_smoothing"}
DATA_ORDER_FLAGS = {"fixed": ("batch_size", "seed"), "tokens": ("max_tokens", "batch_multiple", "pad_multiple", "seed")}


def given_flags(parser: argparse.ArgumentParser, argv: Optional[list]) -> set[str]:
    """The dests of the flags on the command line itself, not their defaults (`parser`: a fresh build_parser())."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    found, _ = parser.parse_known_args(argv)
    return set(vars(found))


def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def inherit(args: argparse.Namespace, explicit: dict[str, str]) -> list[str]:
    """Fill `args` from the checkpoint the run starts from; `explicit`: {dest: where it was given ("--d_model" or
    "recipe R: model.d_model")}. Returns the lines to report (none for a fresh start)."""
    from training.checkpoint.format import SHAPE_FIELDS, read_meta, recorded_tokenizer
    from training.checkpoint.resume import resume_source
    from training.config.sections import CheckpointSection
    section = CheckpointSection(output_dir=args.output_dir, resume=args.resume, ckpt_file=args.ckpt_file,
                                train=args.train)
    path = resume_source(section)
    if path is None:
        return []
    meta = read_meta(path)
    saved = meta["model"]
    taken, overridden = [], []
    # the checkpoint's value for each flag, in the flag's own terms
    want = {dest: saved[field] for dest, field in MODEL_FLAGS.items() if field in saved}
    if "attention_dropout" in want and "dropout" in explicit and "attention_dropout" not in explicit:
        del want["attention_dropout"]                     # it defaults to --dropout, which the user set
    for dest, value in want.items():
        if dest not in explicit:
            setattr(args, dest, value)
            taken.append(f"{dest}={_show(value)}")
            continue
        given = getattr(args, dest)
        same = ((given or args.d_model) == (value or saved["d_model"]) if dest == "ffn_size"    # 0: d_model
                else given == value)
        if same:
            continue
        if MODEL_FLAGS[dest] in SHAPE_FIELDS or dest == "ffn_size":      # (SHAPE_FIELDS names the effective "ffn")
            raise UserError(f"{explicit[dest]} {_show(given)} conflicts with checkpoint {path}, whose weights have "
                            f"{dest}={_show(value)}: they cannot load into another shape. Leave {explicit[dest]} out "
                            f"to continue with the checkpoint's (the layout, dropout and schedule may change)")
        overridden.append(f"{dest}={_show(given)} (checkpoint {_show(value)})")

    tokenizer = recorded_tokenizer(path, meta)
    if tokenizer is not None:
        if "tokenizer" not in explicit:
            args.tokenizer = tokenizer
            taken.append(f"tokenizer={tokenizer}")
        elif (meta.get("tokenizer_sha256") and os.path.isfile(args.tokenizer)
              and file_sha256(args.tokenizer) != meta["tokenizer_sha256"]):
            raise UserError(f"{explicit['tokenizer']} {args.tokenizer} is not the tokenizer checkpoint {path} was "
                            f"trained with (sha256 differs): its token ids would not match the weights. Leave it out "
                            f"to use the checkpoint's own copy ({tokenizer})")

    order = meta.get("data_order")
    if isinstance(order, dict) and order.get("batching") in DATA_ORDER_FLAGS:
        if order["batching"] == "fixed" and "max_tokens" not in explicit:
            args.max_tokens = 0                           # fixed batches: no token batching
        for dest in DATA_ORDER_FLAGS[order["batching"]]:
            if dest in order and dest not in explicit:
                setattr(args, dest, order[dest])
                taken.append(f"{dest}={order[dest]}")

    lines = [f"starting from checkpoint {path}: its settings " + (" ".join(taken) if taken else "(none needed)")]
    if overridden:
        lines.append("overridden by flags: " + " ".join(overridden))
    return lines
