"""The argparse pieces the command-line tools share: numeric flag types that carry the range they accept, and a
parser whose mistakes are one `error:` line.

A numeric flag states what it accepts where it is declared (`--clip_grad` is `number(0, why="0 turns clipping
off")`), so one check serves the command line and a recipe's JSON value (training.config.flags calls the same type
on it, naming the recipe key). Floats must be finite: NaN compares false with every bound, so a check written as
`if value < 0` lets it through — `--clip_grad nan` once trained with clipping silently off.

`Parser` is an ArgumentParser whose errors (a value out of range, an unknown flag, a missing argument) raise
common.errors.UserError, so run_cli prints one `error: --flag VALUE ...` line and exits 2 like every other mistake,
instead of argparse's usage block (39 lines for train.py, printed by every rank of a job).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass

from common.errors import UserError


class OutOfRange(argparse.ArgumentTypeError):
    """A value a numeric flag does not accept: `shown` (the value as given), `problem` ("must be >= 0 ...")."""

    def __init__(self, shown: str, problem: str):
        super().__init__(f"{shown} {problem}")
        self.shown, self.problem = shown, problem


def _bound(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Number:
    """An argparse `type=`: an int or a finite float within [low, high] (either end open, or absent)."""

    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is refused (> instead of >=)
    high_open: bool = False
    why: str = ""  # what the bounds mean, said with a refusal

    @property
    def __name__(self) -> str:  # argparse names a type by it in some messages
        return self.kind.__name__

    def describe(self) -> str:
        """The range in words: '>= 1', '> 0', 'in [0, 1)'."""
        if self.low is not None and self.high is not None:
            return (
                f"in {'(' if self.low_open else '['}{_bound(self.low)}, {_bound(self.high)}"
                f"{')' if self.high_open else ']'}"
            )
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_bound(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_bound(self.high)}"
        return "any value"

    def _refuse(self, shown: str, what: str = "") -> OutOfRange:
        note = f" ({self.why})" if self.why else ""
        return OutOfRange(shown, f"must be {what}{self.describe()}{note}")

    def _parse(self, value, shown: str) -> int | float:
        noun = "an integer " if self.kind is int else "a finite number "
        try:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            if self.kind is int:
                if isinstance(value, float):  # a JSON 32.0 or 1e23 is not an integer flag's value
                    raise ValueError
                return int(value)
            number = float(value)
        except (ValueError, OverflowError):
            raise self._refuse(shown, noun) from None
        if not math.isfinite(number):
            raise self._refuse(shown, noun)
        return number

    def __call__(self, value) -> int | float:
        shown = value if isinstance(value, str) else json.dumps(value)  # json: NaN, not nan
        number = self._parse(value, shown)
        low_ok = self.low is None or (number > self.low if self.low_open else number >= self.low)
        high_ok = self.high is None or (number < self.high if self.high_open else number <= self.high)
        if not (low_ok and high_ok):
            raise self._refuse(shown)
        return number


def integer(low: int | None = None, high: int | None = None, why: str = "") -> Number:
    """An integer flag within [low, high]."""
    return Number(int, low, high, why=why)


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    why: str = "",
) -> Number:
    """A finite float flag within [low, high] (an end is refused itself with low_open / high_open)."""
    return Number(float, low, high, low_open, high_open, why)


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


def _as_typed(name: str | None, argv: list) -> str | None:
    """argparse names a flag with aliases by all its spellings ("--model_parallel/--mp"): the one the user typed
    (the last, whose value argparse took)."""
    if not name or "/" not in name:
        return name
    spellings = name.split("/")
    typed = [str(a).split("=", 1)[0] for a in argv]
    return next((s for s in reversed(typed) if s in spellings), spellings[0])


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UserError (run_cli: one `error:` line, exit 2), naming the flag first."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("exit_on_error", False)  # argparse raises ArgumentError for a bad value: said below
        super().__init__(*args, **kwargs)
        # argparse takes an argument for a value when it looks like a negative number, but its pattern (Python
        # 3.11) has no exponent: `--lenpen -1e30` would be "expected one argument" instead of the value refused
        self._negative_number_matcher = NEGATIVE_NUMBER

    def parse_known_args(self, args=None, namespace=None):
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as err:
            name = _as_typed(err.argument_name, sys.argv[1:] if args is None else args)
            raise UserError(f"{name} {err.message}" if name else err.message) from None

    def error(self, message: str):
        """The errors argparse reports itself (an unknown flag, a required one missing)."""
        raise UserError(f"{message} ({self.prog} --help lists the flags)")
