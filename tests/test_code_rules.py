"""Code rules of docs/design.md ("Code rules") that no linter we run states: an import inside a function says why it
is there; no function over cyclomatic complexity 25 as radon counts it (boolean operators and conditional
expressions count: ruff's C90 in `make lint` does not count them, and let a function reach 44).

The check reads the source (``ast`` for where each import sits, ``tokenize`` for the comments), so it runs on any
text: the tree's own, and a sample written here with a bare function-level import, which it must report."""

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The two reasons a function may import (docs/design.md): what the comment must say, each followed by its why.
REASONS = ("start-up:", "optional:")


def unexplained_imports(source: str, name: str = "<source>") -> list[str]:
    """``name:line`` of every import inside a function (``def``/``async def``/``lambda``, at any depth) with no
    comment naming one of REASONS on one of its lines, or on the comment lines just above it (a comment above a run
    of consecutive imports covers the run). The reason must be followed by words: ``# start-up:`` alone is none."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
    lines = source.splitlines()

    def says_why(line: int) -> bool:
        text = comments.get(line, "")
        return any(reason in text and text.split(reason, 1)[1].strip() for reason in REASONS)

    def comment_only(line: int) -> bool:
        return 1 <= line <= len(lines) and lines[line - 1].lstrip().startswith("#")

    found: list[tuple[ast.stmt, bool]] = []  # (import, inside a function)

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    import_lines = {line for node, _ in found for line in range(node.lineno, node.end_lineno + 1)}
    bad = []
    for node, in_function in found:
        if not in_function:
            continue
        if any(says_why(line) for line in range(node.lineno, node.end_lineno + 1)):
            continue
        above = node.lineno - 1
        while above in import_lines:  # the top of the run of imports this one belongs to
            above -= 1
        covered = False
        while comment_only(above):
            if says_why(above):
                covered = True
                break
            above -= 1
        if not covered:
            bad.append(f"{name}:{node.lineno}")
    return bad


def test_every_function_level_import_in_the_package_says_why():
    """moescope/ only: benchmarks/ and tests/ are scripts and test files, not imported by users, so their imports'
    start-up cost is nobody's (they are left as they are)."""
    bad = []
    for path in sorted((ROOT / "moescope").rglob("*.py")):
        bad += unexplained_imports(path.read_text(), str(path.relative_to(ROOT)))
    assert not bad, ("imports inside a function need a `# start-up: ...` or `# optional: ...` comment "
                     f"(docs/design.md, Code rules), or belong at module level: {bad}")


SAMPLE = '''\
import json


def bare():
    import os
    return os.sep


def said():
    import torch  # start-up: torch, only when said() runs
    # optional: pyarrow (the lake extra)
    import pyarrow
    import pyarrow.parquet as pq
    return torch, pyarrow, pq


def empty_reason():
    import numpy  # start-up:
    return numpy


def a_lambda_and_a_nested_function():
    def inner():
        from moescope import stats
        return stats
    return inner, lambda: __import__("os")


class Holder:
    import sys  # a class body is run at import time: not a function-level import

    def method(self):
        # pulls in the world
        import yaml
        return yaml
'''


def test_the_check_reports_a_bare_function_level_import():
    """The check on a sample whose answer is read off by eye: line 5 (no comment), 18 (a reason with no why), 24
    (a nested function), 34 (a comment above that names no reason); the annotated lines, the run under one comment
    and the module and class-level imports pass."""
    assert unexplained_imports(SAMPLE, "sample") == ["sample:5", "sample:18", "sample:24", "sample:34"]


# -- complexity: radon's count ------------------------------------------------------------------------------------
COMPLEXITY_BAR = 25  # docs/design.md, "Code rules": a function past it is split


def over_complexity(source: str, name: str = "<source>", bar: int = COMPLEXITY_BAR) -> list[str]:
    """``name:line function complexity`` of every function, method and nested function in ``source`` whose
    cyclomatic complexity as radon counts it (``radon cc``: every branch, loop, ``except``, boolean operator and
    conditional expression) is over ``bar``."""
    from radon.complexity import cc_visit
    from radon.visitors import Class

    out: dict[tuple[int, str], str] = {}  # (radon lists a class's methods both in it and beside it)

    def visit(blocks) -> None:
        for b in blocks:
            if isinstance(b, Class):
                visit(b.methods)
                continue
            if b.complexity > bar:
                out[(b.lineno, b.fullname)] = f"{name}:{b.lineno} {b.fullname} {b.complexity}"
            visit(b.closures)

    visit(cc_visit(source))
    return sorted(out.values())


def test_no_function_in_the_package_is_over_the_complexity_bar():
    bad = []
    for path in sorted((ROOT / "moescope").rglob("*.py")):
        bad += over_complexity(path.read_text(), str(path.relative_to(ROOT)))
    assert not bad, f"functions over cyclomatic complexity {COMPLEXITY_BAR} (radon cc; split them): {bad}"


def _branches(n: int, how: str) -> str:
    """A function of complexity ``n + 1``: ``n`` ifs, or one condition of ``n`` ``and``s, or ``n`` conditional
    expressions, or a method of a class with ``n`` ifs in a nested function."""
    if how == "ifs":
        return "def f(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n)) + "    return -1\n"
    if how == "and":
        return "def f(x):\n    return " + " and ".join(f"x[{i}]" for i in range(n + 1)) + "\n"
    if how == "ternary":
        return "def f(x):\n    return " + " + ".join(f"(1 if x[{i}] else 0)" for i in range(n)) + "\n"
    return ("class C:\n    def m(self, x):\n        def inner(y):\n"
            + "".join(f"            if y == {i}:\n                return {i}\n" for i in range(n))
            + "            return -1\n        return inner(x)\n")


@pytest.mark.parametrize("how", ["ifs", "and", "ternary", "nested"])
def test_the_complexity_check_reports_a_function_over_the_bar(how):
    """The check on samples whose complexity is counted by hand: n branches give n + 1 (boolean operators and
    conditional expressions counted as radon counts them); at the bar nothing is reported, one over it is."""
    at, over = _branches(COMPLEXITY_BAR - 1, how), _branches(COMPLEXITY_BAR, how)
    assert over_complexity(at, "sample") == []
    got = over_complexity(over, "sample")
    assert len(got) == 1 and got[0].endswith(f" {COMPLEXITY_BAR + 1}"), got
