"""The import graph between fxmeg's own modules: cycles and forbidden paths.

Stdlib only; the source is parsed with ``ast``, nothing of fxmeg is imported.

Rules:
  * A module's name comes from its path: ``fxmeg/passes/loss.py`` is
    ``fxmeg.passes.loss``, ``fxmeg/passes/__init__.py`` is ``fxmeg.passes``.
  * Every ``import`` and ``from ... import`` in a file counts: at top level,
    inside functions, under ``if TYPE_CHECKING:`` or ``try:`` alike.
  * ``import a.b.c`` is an edge to ``a.b.c`` (or its longest prefix that is a
    module). ``from a.b import c`` is an edge to ``a.b.c`` when that is a module
    (or package), else to ``a.b`` (``c`` is a name defined there). Relative
    imports are resolved against the importing module's package.
  * No implicit edges to parent packages: importing ``fxmeg.passes.loss`` runs
    ``fxmeg/__init__.py`` too, but only an explicit import of ``fxmeg`` (such as
    ``from fxmeg import parallelize``) is an edge to ``fxmeg``.
  * Only edges between modules of the package are kept. Dynamic imports
    (``importlib.import_module("...")``) are not seen.

Forbidden paths (``FORBIDDEN``), direct or through other modules: the passes run on CPU
in one process and never reach the runtime; the runtime reads only the Program the passes
produce, never capture or the passes themselves; ``fxmeg.torch_private`` (every private
torch name fxmeg uses) imports nothing of fxmeg, so every module can import it.

Usage: ``python tools/import_graph.py [--dot] [PACKAGE_DIR]`` prints each
module with its imports, then the cycles and the forbidden paths; the exit status is 1
if there are any. ``--dot`` prints the
graph in Graphviz dot instead.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

FORBIDDEN: tuple[tuple[str, str], ...] = (  # (importer prefix, imported prefix)
    # the flow, bottom up: ir -> frontend / passes -> runtime -> weights / interop ->
    # diagnostics -> train; api.py, at the top, may import anything
    ("fxmeg.ir", "fxmeg.passes"),  # what the passes write knows no pass
    ("fxmeg.ir", "fxmeg.runtime"),
    ("fxmeg.ir", "fxmeg.train"),
    ("fxmeg.passes", "fxmeg.runtime"),  # the passes run on CPU in one process
    ("fxmeg.passes", "fxmeg.diagnostics"),
    ("fxmeg.passes", "fxmeg.train"),
    ("fxmeg.runtime", "fxmeg.frontend"),  # the runtime reads only the Program
    ("fxmeg.runtime", "fxmeg.passes"),
    ("fxmeg.runtime", "fxmeg.train"),
    ("fxmeg.runtime.pipeline", "fxmeg.runtime.data_parallel"),  # schedules know no DDP
    ("fxmeg.runtime.pipeline", "fxmeg.runtime.optimizer"),
    ("fxmeg.weights", "fxmeg.train"),
    ("fxmeg.interop", "fxmeg.train"),
    ("fxmeg.diagnostics", "fxmeg.train"),  # diagnostics may import anything below it
    ("fxmeg.data", "fxmeg.runtime"),  # data reads files, tokenises: no engine
    ("fxmeg.torch_private", "fxmeg"),  # a leaf: any module (passes, runtime) may import it
)


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file under the package directory ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _existing(name: str, modules) -> str | None:
    """``name`` or its longest dotted prefix that is a known module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules) -> set[str]:
    """The known modules that ``module`` (at ``path``) imports, by the rules above."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets.update(_existing(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: ".x" is package.x, "..x" one package up
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else _existing(base, modules))
    targets.discard(None)
    return targets


def import_graph(root: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports; ``root`` is the package directory."""
    modules = _modules(Path(root))
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _shortest(graph, starts, goal) -> list[str] | None:
    """A shortest path from any of ``starts`` to a node for which ``goal`` holds."""
    previous = {start: None for start in starts}
    queue = deque(starts)
    while queue:
        node = queue.popleft()
        if goal(node):
            path = [node]
            while previous[path[-1]] is not None:
                path.append(previous[path[-1]])
            return path[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return None


def find_cycles(graph) -> list[list[str]]:
    """One shortest cycle through each edge that lies on a cycle, e.g. ``[a, b, a]``.

    Breaking every reported cycle leaves the graph acyclic. Duplicates (the
    same cycle found from another of its edges) are dropped.
    """
    cycles, seen = [], set()
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            back = _shortest(graph, [dst], lambda node: node == src)
            if back is None:
                continue
            cycle = [src, *back]  # closed: first == last
            body = cycle[:-1]
            turn = body.index(min(body))
            key = tuple(body[turn:] + body[:turn])
            if key not in seen:
                seen.add(key)
                cycles.append([*key, key[0]])
    return sorted(cycles, key=lambda cycle: (len(cycle), cycle))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def reaches(graph, src_prefix: str, dst_prefix: str) -> list[list[str]]:
    """For each module under ``src_prefix`` that imports, directly or through other
    modules, one under ``dst_prefix``: a shortest such import path."""
    paths = []
    for src in sorted(name for name in graph if _under(name, src_prefix)):
        path = _shortest(graph, [src], lambda node: _under(node, dst_prefix) and node != src)
        if path is not None:
            paths.append(path)
    return paths


def to_dot(graph) -> str:
    on_cycle = {(a, b) for cycle in find_cycles(graph) for a, b in zip(cycle, cycle[1:])}
    lines = ["digraph imports {", "  rankdir=LR;", "  node [shape=box, fontsize=10];"]
    for src in sorted(graph):
        lines.append(f'  "{src}";')
        for dst in sorted(graph[src]):
            style = " [color=red]" if (src, dst) in on_cycle else ""
            lines.append(f'  "{src}" -> "{dst}"{style};')
    return "\n".join(lines + ["}"])


def main(argv: list[str]) -> int:
    dot = "--dot" in argv
    args = [arg for arg in argv if arg != "--dot"]
    root = args[0] if args else str(Path(__file__).resolve().parent.parent / "fxmeg")
    graph = import_graph(root)
    if dot:
        print(to_dot(graph))
        return 0
    for module in sorted(graph):
        print(f"{module} -> {', '.join(sorted(graph[module])) or '(none)'}")
    cycles = find_cycles(graph)
    print(f"\nimport cycles: {len(cycles)}")
    for cycle in cycles:
        print("  " + " -> ".join(cycle))
    found = 0
    for src, dst in FORBIDDEN:
        paths = reaches(graph, src, dst)
        found += len(paths)
        print(f"\nforbidden paths {src} -> {dst}: {len(paths)}")
        for path in paths:
            print("  " + " -> ".join(path))
    print(f"\nforbidden paths: {found}")
    return 1 if cycles or found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
