"""The shape of the code: one home per concern, no import circles, packages layered, every module named in the
docs/code-map.md ("What is where"), every recipe loads into the typed configuration.

Imports are read with `ast` from the source (nothing is imported), function-level imports included: a circle hidden
inside a function is still a circle.
"""

import ast
import re
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT

PACKAGES = ("common", "preprocess", "model", "training", "demos")
# which first-party packages each may import (the layers, bottom up); demos sit on top, nothing imports them
ALLOWED = {
    "common": set(),
    "preprocess": {"common"},
    "model": {"common"},
    "training": {"common", "preprocess", "model"},
    "demos": {"common", "preprocess", "model", "training"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict) -> set[str]:
    """First-party modules `name` imports anywhere in its file (packages count as their __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        out |= {t for t in targets if t in known and t != name}
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle():
    """The check below can fail: a two-module and a three-module circle are found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles():
    found = cycles(graph())
    assert not found, f"import circles: {found}"


def test_packages_import_only_the_layers_below():
    bad = [
        (m, d)
        for m, deps in graph().items()
        for d in deps
        if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in ALLOWED[m.split(".")[0]]
    ]
    assert not bad, f"imports against the layering {ALLOWED}: {bad}"


# training/'s sub-packages, bottom up: each imports only the levels below its own (the trainer sits on top)
# cli/ (the commands) on top of everything
TRAINING_LEVELS = {
    "core": 0,
    "config": 1,
    "checkpoint": 2,
    "run": 3,
    "evaluation": 3,
    "plan": 3,
    "faults_for_tests": 3,
    "trainer": 4,
    "cli": 5,
}


def _training_part(module: str):
    parts = module.split(".")
    return parts[1] if parts[0] == "training" and len(parts) > 1 else None


def test_training_sub_packages_import_only_the_levels_below():
    """No upward import inside training/: the run's lifecycle (run/) above config/ and checkpoint/, the guards of a
    checkpoint write inside checkpoint/, the process group (core/) below all of them."""
    edges = [
        (m, d)
        for m, deps in graph().items()
        for d in deps
        if _training_part(m) and _training_part(d) and _training_part(m) != _training_part(d)
    ]
    unknown = {_training_part(m) for m in modules() if _training_part(m)} - set(TRAINING_LEVELS)
    assert not unknown, f"sub-packages of training/ without a level in TRAINING_LEVELS: {unknown}"
    bad = [(m, d) for m, d in edges if TRAINING_LEVELS[_training_part(d)] >= TRAINING_LEVELS[_training_part(m)]]
    assert not bad, f"imports against training/'s levels {TRAINING_LEVELS}: {bad}"
    assert edges  # the graph was read


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in modules().items()}


def test_where_a_run_starts_has_one_home():
    """The start-point policy is defined in training/run/start_point.py alone and the launch check asks it; the
    `latest` pointer's name is written in training/checkpoint/latest_pointer.py alone (and as --resume's bare value,
    declared with the flag); no module re-derives fresh-or-resumed from the start step (StartPoint.fresh says it);
    the failure tests' hooks say by their module's name that they are the tests'."""
    trees = _trees()
    homes = {}
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                homes.setdefault(node.name, []).append(name)
    for policy in ("resume_source", "check_start_point", "newest_intact", "held_checkpoints", "decide", "agree"):
        assert "training.run.start_point" in homes[policy], policy
    assert [
        h
        for p in ("resume_source", "check_start_point", "newest_intact", "held_checkpoints")
        for h in homes[p]
        if h != "training.run.start_point"
    ] == []
    assert "training.run.start_point" in graph()["training.run.launch_check"]
    latest = sorted(
        {
            name
            for name, tree in trees.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value == "latest"
        }
    )
    assert latest == ["training.checkpoint.latest_pointer", "training.config.sections"], latest

    def is_start_step(node):
        return (isinstance(node, ast.Name) and node.id == "start_step") or (
            isinstance(node, ast.Attribute) and node.attr == "start_step"
        )

    derived = [
        f"{name}:{node.lineno}"
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.Compare)
            and is_start_step(node.left)
            and any(isinstance(c, ast.Constant) and c.value == 0 for c in node.comparators)
        )
        or (isinstance(node, (ast.If, ast.IfExp)) and is_start_step(node.test))
        or (isinstance(node, ast.BoolOp) and any(is_start_step(v) for v in node.values))
        or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and is_start_step(node.operand))
    ]
    assert derived == [], f"fresh-or-resumed re-derived from the start step (use StartPoint.fresh): {derived}"
    hooks = [
        name
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == "DSR_CRASH_AT"
    ]
    assert hooks and all(name.endswith("_for_tests") for name in hooks), hooks


LONGEST_FUNCTION = 80  # lines, decorators and docstring included, as `ruff format` lays the code out


def test_no_function_outside_tests_is_longer_than_80_lines():
    """A function that does one job fits on a screen: past 80 lines, split it into the steps it takes."""
    long = []
    for folder in (*PACKAGES, "benchmarks", "run_scripts"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    if node.end_lineno - first + 1 > LONGEST_FUNCTION:
                        long.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}")
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"


def what_is_where() -> dict[str, str]:
    """docs/code-map.md's code block ("What is where") as {package folder: the text of its entry}."""
    section = (REPO_ROOT / "docs" / "code-map.md").read_text()
    block = re.search(r"```[a-z]*\n(.*?)```", section, re.S).group(1)
    entries, current = {}, None
    for line in block.splitlines():
        head = re.match(r"\s*((?:[a-z_]+/)+)(\s|$)", line)
        if head:
            current = head.group(1)
            entries[current] = entries.get(current, "") + line[head.end() :] + "\n"
        elif current is not None:
            entries[current] += line + "\n"
    return entries


def test_every_module_is_named_in_what_is_where():
    entries = what_is_where()
    missing = []
    for path in modules().values():
        if path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(REPO_ROOT).as_posix() + "/"
        text = entries.get(folder, "")
        if not re.search(rf"(?<![\w/]){re.escape(path.stem)}(\.py)?(?!\w)", text):
            missing.append(f"{folder}{path.name}")
    assert not missing, f"docs/code-map.md does not name: {missing}"


def test_what_is_where_names_only_folders_that_exist():
    stale = [folder for folder in what_is_where() if not (REPO_ROOT / folder).is_dir()]
    assert not stale, stale


@pytest.mark.parametrize(
    "recipe", sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "recipes").glob("*/*.json"))
)
def test_every_recipe_loads_into_the_typed_configuration(recipe):
    """Flags and recipe keys keep their meaning: each recipe becomes a TrainConfig whose sections hold its values."""
    import json

    from training.config.flags import build_parser, parse_config

    config = parse_config(["--recipe", str(REPO_ROOT / recipe)])
    raw = json.loads((REPO_ROOT / recipe).read_text())
    sections = config.to_dict()
    dest_of = {o[2:]: a.dest for a in build_parser()._actions for o in a.option_strings}
    for section in ("model", "parallel", "training"):
        for key, value in raw.get(section, {}).items():
            if key.startswith("_"):
                continue
            held = [s[dest_of[key]] for s in sections.values() if isinstance(s, dict) and dest_of[key] in s]
            assert held and all(v == value for v in held), (recipe, section, key, value, held)
    assert config.parallel.deepspeed_overrides == {
        k: v for k, v in raw.get("deepspeed", {}).items() if not k.startswith("_")
    }


def test_ci_runs_exactly_the_readmes_test_command():
    """`.ci/run` runs the README's test command, character for character (the two commands of the README)."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(blocks) == 2, blocks
    ci = (REPO_ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == blocks[1].strip()


def test_the_installed_package_holds_every_package():
    """setup.cfg's packages.find includes every first-party package and sub-package: a non-editable install with
    common/ or demos/ missing could not import training (common.errors) at all."""
    import configparser

    from setuptools import find_packages

    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    include = cfg["options.packages.find"]["include"].split()
    installed = set(find_packages(where=str(REPO_ROOT), include=include))
    on_disk = {
        ".".join(p.parent.relative_to(REPO_ROOT).parts)
        for package in PACKAGES
        for p in (REPO_ROOT / package).rglob("__init__.py")
    }
    assert on_disk and on_disk <= installed, sorted(on_disk - installed)
    assert all(name.split(".")[0] in PACKAGES for name in installed), installed


# what starts a process group (directly or through train.py's or the demos' code)
PROCESS_GROUP_STARTERS = re.compile(
    r"\b(init_distributed|init_process_group|run_training|build_ours|train_digits|"
    r"run_distributed|join_job|import train|from demos\.\w+\.train|"
    r"training\.cli\.train)\b"
)
ENTRY_FOLDERS = ("run_scripts", "benchmarks", "tests/drivers", "demos")


def _main_block(tree: ast.Module):
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        ):
            return node
    return None


def test_every_entry_point_that_starts_a_process_group_leaves_through_run_cli():
    """One exit path (common.errors.run_cli → leave): a launched rank leaving through the interpreter's teardown can
    abort after its work is done (SIGABRT around the process group's native threads)."""
    checked, wrong = [], []
    for folder in ENTRY_FOLDERS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            source = path.read_text()
            tree = ast.parse(source, str(path))
            block = _main_block(tree)
            if block is None or not PROCESS_GROUP_STARTERS.search(source):
                continue
            calls = {
                getattr(n.func, "attr", getattr(n.func, "id", None)) for n in ast.walk(block) if isinstance(n, ast.Call)
            }
            checked.append(path.relative_to(REPO_ROOT).as_posix())
            if "run_cli" not in calls:
                wrong.append(checked[-1])
    assert not wrong, f"entry points that start a process group but do not leave through run_cli: {wrong}"
    assert {
        "run_scripts/train.py",
        "run_scripts/sharded_mlp.py",
        "tests/drivers/train_many.py",
        "benchmarks/profile_step.py",
    } <= set(checked), checked


def test_the_readme_is_a_user_guide_of_at_most_300_lines():
    """Details live in docs/ (one page per topic); the front page stays short enough to read."""
    lines = (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move details into docs/"


SHARED_HELPERS = ("train_flags", "step_dir", "merged", "one_error", "usage_error", "run_tool")


def top_level_functions(folder: Path) -> list[tuple[str, str, str]]:
    """(file, name, body) of each top-level function (fixtures included) under `folder`; the body is its arguments
    and statements as `ast` reads them, the docstring left out (two copies with other words are still copies)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        for node in ast.parse(path.read_text(encoding="utf-8"), rel).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                found.append((rel, node.name, ast.dump(node.args) + ast.dump(ast.Module(body=body, type_ignores=[]))))
    return found


def test_no_test_helper_is_copied_between_test_files():
    """A helper two test files need lives once (tests/launch.py, tests/conftest.py, …) and both import it: a copy
    drifts (four `flags`, three `step_dir` and `merged`, five one-error checks were here, each a little different)."""
    functions = top_level_functions(REPO_ROOT / "tests")
    seen, copies = {}, []
    for rel, name, body in functions:
        if (name, body) in seen:
            copies.append(f"{name}: {seen[name, body]} and {rel}")
        seen.setdefault((name, body), rel)
    assert not copies, copies
    defined = {}
    for rel, name, _ in functions:
        defined.setdefault(name, []).append(rel)
    assert {name: defined[name] for name in SHARED_HELPERS} == {name: ["tests/launch.py"] for name in SHARED_HELPERS}
