"""User-facing errors: one line, no traceback, non-zero exit.

Every command-line entry point of the repository (preprocess tools, run_scripts) wraps its `main` with
`run_cli`, so a user mistake (bad file, bad flag combination, bad parallel layout) prints
`error: <what is wrong and how to fix it>` and exits with status 2, while a genuine bug still shows its traceback.
"""
from __future__ import annotations

import sys
from typing import Callable, NoReturn


class UserError(Exception):
    """A mistake in the user's input or configuration; the message must name the bad value and the fix."""


def fail(message: str) -> NoReturn:
    raise UserError(message)


def run_cli(main: Callable[[], object]) -> NoReturn:
    try:
        result = main()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(int(result or 0))
