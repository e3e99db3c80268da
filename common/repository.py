"""Where the repository is, and which commit it is at.

A recipe folder copied out of the repository (the recipes README's advice: copy one and edit it) has no relative
path back to `run_scripts/`; its `run.sh` asks, in this order: the environment variable DSR_ROOT, the repository it
sits in (`recipes/NAME/../..`), and then this module — `python -m common.repository` prints the root of the
repository the installed package comes from (`pip install -e .` installs it from the checkout itself). A
non-editable install copies only the Python packages, not the launch scripts, so there DSR_ROOT must name the
checkout.

`git_commit()` is the code version run.json records ("unknown" outside a git checkout or without git).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.errors import UserError, run_cli

ENV = "DSR_ROOT"
LAUNCHER = Path("run_scripts") / "run.sh"  # what marks a checkout: the launch scripts are files, not a package


def repo_root() -> Path:
    """The repository's root: $DSR_ROOT if set, else the folder above this package (an editable install or a
    checkout on PYTHONPATH). UserError naming DSR_ROOT when neither holds run_scripts/run.sh."""
    given = os.environ.get(ENV)
    if given:
        root = Path(given).expanduser().resolve()
        if not (root / LAUNCHER).is_file():
            raise UserError(
                f"{ENV}={given} is not the repository's folder (it has no {LAUNCHER}); set {ENV} to "
                f"the folder you cloned, or unset it"
            )
        return root
    root = Path(__file__).resolve().parent.parent
    if not (root / LAUNCHER).is_file():
        raise UserError(
            f"the installed package at {root} is not a checkout of the repository (no {LAUNCHER}: a "
            f"non-editable install has the Python packages only); set {ENV}=/path/to/the/repository, "
            f"or install it with `pip install -e .` from the checkout"
        )
    return root


def git_commit(root: Path | None = None) -> str:
    """HEAD's commit hash of the checkout at `root` (default: this code's), with "+dirty" when tracked files
    changed since; "unknown" outside git."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(
            "usage: python -m common.repository\n  prints the repository's root folder ($DSR_ROOT, else the "
            "checkout the installed package comes from); recipes' run.sh use it to find run_scripts/"
        )
        return 0
    if args:
        raise UserError(f"unexpected argument {args[0]!r}: python -m common.repository takes none (see --help)")
    print(repo_root())
    return 0


if __name__ == "__main__":
    run_cli(main)
