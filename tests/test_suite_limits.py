"""The suite's limits grow with the load: no command's timeout, no wait's deadline, no "ended within" bound and no
bound on a time the test measured itself (`took = clock() - start; assert took < N`) in the tests is a bare number
of seconds; each is the idle machine's limit × tests/progress.py's load factor
(`scaled`). Beside four 2-rank training jobs (load 30 on 2 cores) a train.py start that fails before any work took
over a minute, and the test's fixed `< 60` failed, not the code.

Read with `ast` from the tests' source. Not counted: tests/progress.py's own polling and the drivers (they are the
commands, not the tests)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.launch import REPO_ROOT

TESTS = REPO_ROOT / "tests"
NOT_COUNTED = {TESTS / "progress.py", *TESTS.glob("drivers/*.py"), Path(__file__).resolve()}
# the helpers that scale the timeout they are given (tests/launch.py, tests/progress.py, the SLURM cluster's waits,
# the files' own finish and read_line helpers)
SCALED_INSIDE = {
    *("run_python", "run_train", "run_tool", "run_script", "run_many", "run_ranks", "wait_exit", "wait_until"),
    *("finish", "job.finish", "slurm.wait", "slurm.wait_final", "slurm.run", "read_line", "ended_within"),
}
CLOCKS = {"time.time", "time.monotonic", "time.perf_counter"}


def _bare_number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool)


def _scaled(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) in ("scaled", "progress.scaled")


def _clock(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) in CLOCKS


def _elapsed(node: ast.AST) -> bool:
    """clock() - start, or that in other units: (clock() - start) * 1000"""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _elapsed(node.left) or _elapsed(node.right)
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _clock(node.left)


def fixed_limits(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of each limit in `tree` that is a bare number, or scaled twice."""
    found = []
    timed = {  # names that hold a measured time: `took = clock() - start`
        node.targets[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and _elapsed(node.value)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) not in SCALED_INSIDE:
            found += [(kw.lineno, f"timeout={kw.value.value}") for kw in node.keywords if kw.arg == "timeout"
                      if _bare_number(kw.value)]  # fmt: skip
        elif isinstance(node, ast.Call):  # a helper that scales: given a scaled limit, it would scale it twice
            given = [*node.args, *(kw.value for kw in node.keywords)]
            found += [(a.lineno, f"{ast.unparse(node.func)}(... {ast.unparse(a)} ...)") for a in given if _scaled(a)]
        deadline = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _clock(node.left)
        if deadline and _bare_number(node.right):  # clock() + N
            found.append((node.lineno, ast.unparse(node)))
        bound = isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Lt | ast.LtE)
        measured = bound and (_elapsed(node.left) or isinstance(node.left, ast.Name) and node.left.id in timed)
        if measured and _bare_number(node.comparators[0]):  # clock() - start < N, or took < N
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_limit_in_the_tests_is_a_bare_number_of_seconds():
    files = [p for p in sorted(TESTS.rglob("*.py")) if p not in NOT_COUNTED]
    found = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {what}"
        for path in files
        for line, what in fixed_limits(ast.parse(path.read_text(), str(path)))
    ]
    assert found == [], "limits that do not grow with the load (wrap them in tests.progress.scaled):\n" + "\n".join(
        found
    )
    assert len(files) > 50


def test_the_check_finds_each_kind_of_fixed_limit():
    source = (
        "subprocess.run(cmd, timeout=60)\n"
        "proc.wait(timeout=2.5)\n"
        "deadline = time.monotonic() + 30\n"
        "assert time.time() - start < 60\n"
        "run_train(2, flags, timeout=scaled(300))\n"  # run_train scales it again
        "took = time.perf_counter() - start\n"
        "assert took < 20\n"
        "ms = (time.perf_counter() - start) * 1000\n"
        "assert ms <= 200\n"
        "subprocess.run(cmd, timeout=scaled(60))\n"  # these are fine
        "run_python(cmd, timeout=300)\n"
        "deadline = time.monotonic() + scaled(30)\n"
        "assert time.time() - start < scaled(60)\n"
        "assert took < scaled(20) and took < other / 4\n"
    )
    assert [line for line, _ in fixed_limits(ast.parse(source))] == [1, 2, 3, 4, 5, 7, 9]
