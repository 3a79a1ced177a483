"""The longest functions under a folder (default fxmeg/), in code lines: the lines from
``def`` to the function's last line, blank lines and docstrings excluded (a docstring is
prose that says why; it should not push a function over the limit). STYLE asks for ~40,
a reason past 80; tests/repo/test_code_size.py holds every function of fxmeg/ to ``LIMIT``.

Usage: python tools/longest_functions.py [DIR] [N]"""

from __future__ import annotations

import ast
import pathlib
import sys

LIMIT = 60
"""Most code lines a function of fxmeg/ may have (tests/repo/test_code_size.py)."""


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers of every docstring: a bare string statement (a module's, class's or
    function's first statement, or an attribute's docstring after it)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def code_lines(
    node: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str], docstrings: set[int]
) -> int:
    """``node``'s lines (``def`` to its end, decorators excluded) that are neither blank
    nor part of a docstring."""
    span = range(node.lineno, node.end_lineno + 1)
    return sum(1 for i in span if i not in docstrings and source[i - 1].strip())


def functions(root: str) -> list[tuple[int, str]]:
    """(code lines, 'path:line name') of every function and method under ``root``."""
    rows = []
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree, source = ast.parse(text), text.splitlines()
        docstrings = _docstring_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                rows.append(
                    (code_lines(node, source, docstrings), f"{path}:{node.lineno} {node.name}")
                )
    return rows


def longest(root: str, n: int = 10) -> list[tuple[int, str]]:
    return sorted(functions(root), reverse=True)[:n]


if __name__ == "__main__":
    args = sys.argv[1:]
    for lines, where in longest(
        args[0] if args else "fxmeg", int(args[1]) if len(args) > 1 else 10
    ):
        print(f"{lines:4d}  {where}")
