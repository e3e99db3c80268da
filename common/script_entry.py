"""How a file in run_scripts/ finds its code: the installed package (`pip install -e .`), never a path of its own.

A script run by its path (`python run_scripts/train.py`, the launchers' ranks, a copied recipe's DSR_ROOT) has its
own folder on sys.path, not the checkout's root, so the checkout's code comes from the installed package or from
$PYTHONPATH. That code must be the script's own checkout: with another clone installed (`pip install -e` run in
another folder), the script would run the other clone's code without a word. `require_own_checkout` refuses that in
one line. A non-editable install (the packages copied into site-packages, no checkout around them) is the code the
user chose to install, and runs.
The repository's own launchers (run_scripts/launch_common.sh, translation_recipe.sh, benchmarks/gpu_session.sh)
put their checkout first on PYTHONPATH, so what they start runs their code, installed or not.

Each script imports this module inside `try`, so that a machine without the package gets one line as well:

    try:
        from common.script_entry import require_own_checkout
    except ModuleNotFoundError:
        print("error: ... `pip install -e .` ...", file=sys.stderr)
        sys.exit(2)
    require_own_checkout(__file__)
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = Path("run_scripts") / "run.sh"  # what makes a folder a checkout (as common.repository.LAUNCHER)


def package_root() -> Path:
    """The folder the imported `common` package sits in."""
    return Path(__file__).resolve().parent.parent


def other_checkout(script: str) -> str | None:
    """Why `script` (a file in a checkout's run_scripts/) must not run: the imported package is another checkout;
    None when it is the script's own, or an install that is no checkout."""
    theirs, ours = package_root(), Path(script).resolve().parent.parent
    if theirs == ours or not (theirs / MARK).is_file() or not (ours / MARK).is_file():
        return None
    return (
        f"run_scripts/{Path(script).name} is in the checkout {ours}, but Python imports this repository's "
        f"code from another checkout, {theirs} (installed there with `pip install -e .`, or on PYTHONPATH), "
        f"which would run instead. Run `pip install -e {ours}` to use this checkout, or run the scripts of "
        f"{theirs}"
    )


def require_own_checkout(script: str) -> None:
    """One `error:` line and exit status 2 (a user error, as common.errors.run_cli reports one) unless the code
    imported is `script`'s own checkout; called before anything else of the repository is imported."""
    why = other_checkout(script)
    if why is not None:
        print(f"error: {why}", file=sys.stderr, flush=True)
        sys.exit(2)
