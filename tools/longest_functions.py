"""The longest functions under a folder (default fxmeg/), by lines: STYLE asks for ~40,
and a reason past 80. Usage: python tools/longest_functions.py [DIR] [N]"""

import ast
import pathlib
import sys


def longest(root: str, n: int = 10) -> list[tuple[int, str]]:
    rows = []
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                rows.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)[:n]


if __name__ == "__main__":
    args = sys.argv[1:]
    for lines, where in longest(args[0] if args else "fxmeg", int(args[1]) if len(args) > 1 else 10):
        print(f"{lines:4d}  {where}")
