"""The codebase stays linted and formatted: ruff (pyproject.toml [tool.ruff]) is clean, `ruff format --check` finds
nothing to change, the pre-commit hooks run the same checks, and every `# noqa` says why."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.progress import scaled

needs_ruff = pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")


@needs_ruff
def test_ruff_is_clean():
    proc = subprocess.run(
        ["ruff", "check", "--no-cache", "."], cwd=REPO_ROOT, capture_output=True, text=True, timeout=scaled(300)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@needs_ruff
def test_the_code_is_formatted():
    proc = subprocess.run(
        ["ruff", "format", "--check", "--no-cache", "."],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@needs_ruff
def test_the_pre_commit_hooks_run_the_same_checks(tmp_path):
    """Each local hook is ruff with the repository's settings, run as pre-commit would (as a check here: without
    fixing), and catches what it is for in a copy: the linter an unused import, the formatter a line it would change."""
    config = yaml.safe_load((REPO_ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    assert list(hooks) == ["ruff", "ruff-format"] and all(h["language"] == "system" for h in hooks.values())
    lint = [a for a in hooks["ruff"]["entry"].split() if a != "--fix"]
    fmt = [*hooks["ruff-format"]["entry"].split(), "--check"]
    assert lint[:2] == ["ruff", "check"] and fmt[:2] == ["ruff", "format"]
    settings = ["--no-cache", "--config", str(REPO_ROOT / "pyproject.toml")]
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport sys\n\nprint(sys.argv)\n")  # an unused import: F401
    proc = subprocess.run([*lint, *settings, str(bad)], capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 1 and "F401" in proc.stdout, proc.stdout + proc.stderr
    unformatted = tmp_path / "unformatted.py"
    unformatted.write_text("x = {  'a':1 }\n")
    proc = subprocess.run([*fmt, *settings, str(unformatted)], capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 1 and "unformatted.py" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    formatted = tmp_path / "formatted.py"
    formatted.write_text('x = {"a": 1}\n')
    proc = subprocess.run([*fmt, *settings, str(formatted)], capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_formatting_commit_is_left_out_of_blame():
    """.git-blame-ignore-revs lists the commit that adopted `ruff format` (and, where the history is here, that
    commit only reformatted: its message says so)."""
    revs = [
        line.strip()
        for line in (REPO_ROOT / ".git-blame-ignore-revs").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert revs and all(re.fullmatch(r"[0-9a-f]{40}", rev) for rev in revs), revs
    shown = subprocess.run(
        ["git", "log", "-1", "--format=%s", revs[0]], cwd=REPO_ROOT, capture_output=True, text=True, timeout=scaled(60)
    )
    if shown.returncode == 0:  # a shallow clone may not hold it
        assert shown.stdout.startswith("ruff format:"), shown.stdout


NOQA = re.compile(r"#\s*noqa\b(?P<rest>.*)$")


def test_every_noqa_says_why():
    """`# noqa: CODE` must be followed by its reason on the same line (`# noqa: E402 - after the sys.path line`)."""
    bare = []
    for path in sorted(REPO_ROOT.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).parts
        if parts[0] in {"data", ".git"} or any(p.endswith(".egg-info") for p in parts):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = NOQA.search(line)
            if m and not re.search(r"[A-Za-z]{3,}", re.sub(r"^:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*", "", m["rest"])):
                bare.append(f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}")
    assert not bare, "a # noqa without its reason:\n" + "\n".join(bare)
