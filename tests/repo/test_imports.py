"""fxmeg's own import structure: no cycles, and none of the forbidden paths
(tools/import_graph.py's FORBIDDEN: passes never reach the runtime, the runtime never
reaches capture or the passes).

The checker is tools/import_graph.py (not a package, so it is loaded by path);
its own behaviour is pinned on small synthetic packages written to tmp_path.
"""

import functools
import importlib.util
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)


def _show(paths):
    return "\n".join("  " + " -> ".join(path) for path in paths)


@functools.cache
def _fxmeg_graph():
    return ig.import_graph(str(REPO / "fxmeg"))


def test_fxmeg_has_no_import_cycles():
    cycles = ig.find_cycles(_fxmeg_graph())
    assert not cycles, f"import cycles among fxmeg modules:\n{_show(cycles)}"


@pytest.mark.parametrize("importer, imported", ig.FORBIDDEN, ids=lambda name: name.split(".")[-1])
def test_forbidden_paths(importer, imported):
    paths = ig.reaches(_fxmeg_graph(), importer, imported)
    assert not paths, f"{importer} modules that import {imported}:\n{_show(paths)}"


def test_forbidden_pairs_keep_the_pipeline_order():
    """The runtime reads only the Program: never capture, never the passes."""
    assert {("fxmeg.passes", "fxmeg.runtime"), ("fxmeg.runtime", "fxmeg.frontend"),
            ("fxmeg.runtime", "fxmeg.passes")} <= set(ig.FORBIDDEN)


def _imported_top_levels(*folders: str) -> set[str]:
    """The top-level names every ``import`` / ``from ... import`` in the folders reads."""
    import ast

    names = set()
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names.add(node.module.split(".")[0])
    return names


def test_every_core_dependency_is_imported_by_the_package():
    """pyproject's dependencies are what the installed packages (fxmeg, models) import:
    none declared for nothing (a test-only one, such as einops for the zoo, goes in the
    test extra)."""
    import re

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    declared = {re.match(r"[A-Za-z0-9_.-]+", d).group().lower().replace("-", "_")
                for d in project["dependencies"]}
    unused = declared - _imported_top_levels("fxmeg", "models")
    assert not unused, (
        f"declared in pyproject.toml, imported by no fxmeg / models module: {sorted(unused)}"
    )
    extras = project["optional-dependencies"]
    assert "te" not in extras and "einops" in " ".join(extras["test"])  # einops: tests only


# ---- the checker itself, on synthetic packages ---------------------------------------


def _package(tmp_path, files):
    """Write ``{relative path: source}`` under tmp_path/pkg; return the package directory."""
    root = tmp_path / "pkg"
    for rel, source in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return str(root)


def test_module_names_and_no_implicit_parent_edges(tmp_path):
    root = _package(tmp_path, {
        "a.py": "import os\nfrom pkg.sub.deep import thing\n",
        "sub/__init__.py": "",
        "sub/deep.py": "import pkg.a\n",
    })
    graph = ig.import_graph(root)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.sub.deep"},  # not pkg.sub nor pkg: parents are not counted
        "pkg.sub": set(),
        "pkg.sub.deep": {"pkg.a"},
    }


def test_cycle_through_type_checking_import_is_found(tmp_path):
    root = _package(tmp_path, {
        "api.py": "from pkg.checkpoint import save\n",
        "checkpoint.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.api import Engine
            def save(engine: "Engine"): ...
        """,
        "leaf.py": "from pkg.api import save\n",
    })
    graph = ig.import_graph(root)
    assert graph["pkg.checkpoint"] == {"pkg.api"}
    assert ig.find_cycles(graph) == [["pkg.api", "pkg.checkpoint", "pkg.api"]]


def test_function_level_import_counts(tmp_path):
    root = _package(tmp_path, {
        "a.py": "def f():\n    from pkg import b\n    return b\n",
        "b.py": "class C:\n    def m(self):\n        import pkg.a\n",
    })
    graph = ig.import_graph(root)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert ig.find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_from_package_import_resolves_submodule_or_package(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from pkg.api import parallelize\n",
        "api.py": "def parallelize(): ...\n",
        "ops.py": "",
        "passes/__init__.py": "",
        "passes/loss.py": "from pkg import ops\nfrom pkg.passes import util as u\n",
        "passes/util.py": "from pkg import parallelize\n",  # a name: the edge is to pkg
        "passes/rel.py": "from . import loss\nfrom .. import ops\nfrom ..api import parallelize\n",
    })
    graph = ig.import_graph(root)
    assert graph["pkg.passes.loss"] == {"pkg.ops", "pkg.passes.util"}
    assert graph["pkg.passes.util"] == {"pkg"}
    assert graph["pkg.passes.rel"] == {"pkg.passes.loss", "pkg.ops", "pkg.api"}
    assert ig.find_cycles(graph) == []  # pkg -> api, util -> pkg: no way back


def test_self_import_is_a_cycle(tmp_path):
    root = _package(tmp_path, {"__init__.py": "X = 1\nfrom pkg import X as Y\n"})
    assert ig.find_cycles(ig.import_graph(root)) == [["pkg", "pkg"]]


def test_forbidden_chain_through_another_module_is_reported(tmp_path):
    root = _package(tmp_path, {
        "passes/__init__.py": "",
        "passes/tp.py": "import pkg.collectives\n",
        "passes/loss.py": "from pkg.passes import tp\n",
        "passes/clean.py": "from pkg import ops\n",
        "collectives.py": "from pkg.runtime.groups import gather\n",
        "ops.py": "",
        "runtime/__init__.py": "",
        "runtime/groups.py": "def gather(): ...\n",
    })
    graph = ig.import_graph(root)
    assert ig.reaches(graph, "pkg.passes", "pkg.runtime") == [
        ["pkg.passes.loss", "pkg.passes.tp", "pkg.collectives", "pkg.runtime.groups"],
        ["pkg.passes.tp", "pkg.collectives", "pkg.runtime.groups"],
    ]
    assert ig.reaches(graph, "pkg.passes", "pkg.nothing") == []
    assert ig.find_cycles(graph) == []


def test_script_exit_status(tmp_path, capsys):
    clean = _package(tmp_path / "clean", {"a.py": "from pkg import b\n", "b.py": ""})
    assert ig.main([clean]) == 0
    cyclic = _package(tmp_path / "cyclic", {"a.py": "from pkg import b\n", "b.py": "import pkg.a"})
    assert ig.main([cyclic]) == 1
    assert "pkg.a -> pkg.b -> pkg.a" in capsys.readouterr().out
    assert ig.main(["--dot", cyclic]) == 0
    assert '"pkg.a" -> "pkg.b" [color=red];' in capsys.readouterr().out


def test_package_inits_hold_only_a_docstring():
    """Package ``__init__`` files stay empty (a docstring at most): importing a package runs
    nothing and every name is found in the module that defines it. fxmeg/__init__.py, the
    lazy public API (``fxmeg.parallelize`` ...), is the one exception."""
    import ast

    root = REPO / "fxmeg"
    busy = []
    for init in sorted(root.rglob("__init__.py")):
        if init.parent == root:
            continue
        body = ast.parse(init.read_text()).body
        if any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body):
            busy.append(str(init.relative_to(root.parent)))
    assert not busy, f"package inits with code (move it into a module): {busy}"
