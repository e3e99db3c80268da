"""How one train.py setting is declared: a section field made by `setting(...)` carries its flag's help, type with
its range, the seed's alias and what a checkpoint carries it as. The parser, the recipe keys, TrainConfig and the
checkpoint's lists (training.checkpoint.carried_settings) are read from these declarations (docs/settings.md)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from common.cli_args import integer, number
from model.config import MAX_POSITIONS
from preprocess.tokenizer import BPE_SPECIALS

# What a checkpoint's meta.json carries a setting as; a run that starts from it takes the value unless the user set
# the flag (training.checkpoint.carried_settings). SHAPE: meta.json "model"; TRAJECTORY: its "optimization"; the
# data order ("data_order") records the settings of its batching: FIXED_ORDER for fixed batches, TOKEN_ORDER for
# token batches
SHAPE, TRAJECTORY, FIXED_ORDER, TOKEN_ORDER = "model", "optimization", "fixed", "tokens"


def as_bool(v) -> bool:
    """A 0/1 flag: true/false, 1/0, yes/no, on/off (the seed's flags are 0/1)."""
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false or 1/0, got {v!r}")


# Ranges of the numeric settings (common.cli_args): the command line and a recipe's values are checked by the same
# type. Ranges that depend on other settings or on the world size are model.config.validate_layout's.
POSITIVE = integer(1)
LENGTH = integer(
    2,
    MAX_POSITIONS,
    why=f"at least one token plus BOS/EOS; at most {MAX_POSITIONS} positions: "
    f"attention keeps length² scores per head and sequence, 1 GiB at {MAX_POSITIONS}. Longer sentences "
    f"are cut to the length, so choose one that covers most of yours, e.g. 128",
)
PROBABILITY = number(0, 1, high_open=True)
# the seed feeds numpy's generators (any integer >= 0; -1 failed at the first epoch) and torch.manual_seed (up to
# 2**64 - 1, with room kept for the stream offsets model.parallel.random adds): [0, 2**32 - 1], numpy's classic range
SEED = integer(0, 2**32 - 1)
# blocks per stack: DeepNet, the deepest Transformer published, has 1,000 layers in all; the bound keeps a typo
# (100000) from building and planning 10⁵ blocks for minutes before anything is said
MAX_LAYERS = 1000
LAYERS = integer(1, MAX_LAYERS, why="blocks of this stack; DeepNet, the deepest published Transformer, has 1000 in all")
TOKENIZER_VOCAB = integer(len(BPE_SPECIALS) + 1, why=f"more than the {len(BPE_SPECIALS)} special tokens")
# torch counts a collective's deadline in 64-bit nanoseconds from now: 1e9 s (31 years) stays far inside it
COMM_TIMEOUT = number(0, 1e9, low_open=True, why="seconds")


@dataclass(frozen=True)
class Declared:
    """One setting as the user meets it (the field holding it gives its name, default and section)."""

    help: str
    kind: Callable | None = None  # argparse type: a Number with its range, as_bool, int; None: a string
    aliases: tuple[str, ...] = ()  # the seed's spellings, taken on the command line and as recipe keys
    choices: tuple | None = None
    metavar: str | None = None
    carried: tuple[str, ...] = ()  # SHAPE, TRAJECTORY, FIXED_ORDER, TOKEN_ORDER
    saved_as: str | None = None  # its key in meta.json "model" where ModelConfig's name differs
    nargs: str | None = None  # --resume takes an optional value ...
    const: str | None = None  # ... "latest" when given bare

    def add_to(self, group, name: str, default) -> None:
        extra = {
            k: v
            for k, v in (
                ("nargs", self.nargs),
                ("const", self.const),
                ("metavar", self.metavar),
                ("choices", self.choices),
            )
            if v is not None
        }
        group.add_argument(
            f"--{name}",
            *(f"--{a}" for a in self.aliases),
            dest=name,
            type=self.kind,
            default=default,
            help=self.help,
            **extra,
        )


def setting(default, help: str, kind: Callable | None = None, **how) -> dataclasses.Field:
    """A section field that is a train.py flag and recipe key of the same name (Declared's fields: `how`)."""
    return field(default=default, metadata={"setting": Declared(help, kind, **how)})


def copy_of(section: type, name: str) -> dataclasses.Field:
    """A field that holds another section's setting too (one flag, read by both: the seed, the train switch)."""
    declared = {f.name: f for f in dataclasses.fields(section)}[name]
    return field(default=declared.default, metadata={"copy_of": section})


def flag_from(adder: Callable) -> dataclasses.Field:
    """A field whose flag another module declares for every command that takes it (`adder(group)` adds it)."""
    return field(default=None, metadata={"flag_from": adder})


def declarations(sections: dict) -> list[tuple[str, str, Declared]]:
    """(section name, setting name, declaration) of every declared setting, in section and field order."""
    return [
        (name, f.name, f.metadata["setting"])
        for name, kind in sections.items()
        for f in dataclasses.fields(kind)
        if "setting" in f.metadata
    ]
