"""The pass list is written once, as ``fxmeg.frontend.pass_driver.PASSES``; everything else that
lists the passes (their checks, fxmeg/passes/__init__.py's table, docs/architecture.md's table and
flow), the Program's fields (docs/architecture.md §2) or the metadata keys (docs/architecture.md
§2's table, the one list of them) is held to the code here, in order and with nothing extra."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import fxmeg.passes
from fxmeg.frontend.pass_driver import NAMES, PASSES
from fxmeg.ir.program import Program
from fxmeg.passes import verify

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table that opens with ``header``."""
    lines = text[text.index(header):].splitlines()[2:]  # [2:]: header and |---| rule
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _section(text: str, start: str, end: str) -> str:
    at = text.index(start)
    return text[at : text.index(end, at)]


def test_every_pass_is_its_own_file_and_has_its_check():
    for p in PASSES:
        assert (p.run.__module__, p.run.__name__) == (f"fxmeg.passes.{p.name}", p.name)
        assert p.check is getattr(verify, p.name), f"{p.name}'s check is not verify.{p.name}"
    checks = {name for name, f in inspect.getmembers(verify, inspect.isfunction)
              if f.__module__ == verify.__name__ and not name.startswith("_")}
    assert checks == set(NAMES), "verify.py checks a pass that is not in PASSES"
    own = {
        f.stem
        for f in (ROOT / "fxmeg" / "passes").glob("*.py")
        if not f.stem.startswith("_")
        and hasattr(importlib.import_module(f"fxmeg.passes.{f.stem}"), f.stem)
    }
    assert own - {"verify"} == set(NAMES), (
        "a file in fxmeg/passes/ defines its pass but PASSES misses it"
    )


def test_package_docstring_lists_the_passes_in_order():
    rows = re.findall(r"^  (\w+) +(\w+) +.* passes/(\w+)\.py$", fxmeg.passes.__doc__, re.MULTILINE)
    assert rows == [(p.name, p.scope.value, p.name) for p in PASSES]


def test_design_table_lists_the_passes_in_order():
    rows = _table(ARCHITECTURE, "| Pass | Scope | Requires | Ensures |")
    assert [tuple(r[:2]) for r in rows] == [(p.name, p.scope.value) for p in PASSES]


def test_design_flow_lists_the_passes_in_order():
    flow = _section(ARCHITECTURE, "## 1. The flow", "▼ Program")
    chain = " ".join(
        line.strip(" │▼").split(":")[-1] for line in flow.splitlines() if " -> " in line
    )
    assert re.split(r"\s*->\s*", chain.strip(" ->")) == list(NAMES)


def test_design_lists_every_program_field():
    rows = _table(ARCHITECTURE, "| Field | What |")
    listed = [name for row in rows for name in re.findall(r"`(\w+)`", row[0])]
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(Program))


_WRITES = (
    re.compile(r"""set_tag\(\s*[^,()]+,\s*"(\w+)","""),  # set_tag(node, "loss", "sum")
    re.compile(r"""set_tags\(\s*[^,()]+,\s*\{\s*"(\w+)":"""),  # set_tags(chunk, {"spec": ...})
)
_RAW = re.compile(r"""meta(\["fxmeg"\]|\.get\("fxmeg"|\.setdefault\("fxmeg")""")


def _code_lines(path: Path):
    """(line number, line) of the code of ``path``: docstrings and comments left out."""
    import ast

    text = path.read_text()
    prose = {n for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Expr)
             and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
             for n in range(node.lineno, node.end_lineno + 1)}
    for i, line in enumerate(text.splitlines(), 1):
        if i not in prose:
            yield i, line.split("#")[0]


def _written_keys() -> set[str]:
    """Every key the package's code writes (``fxmeg.ir.tags.set_tag`` / ``set_tags``)."""
    found = set()
    for path in (ROOT / "fxmeg").rglob("*.py"):
        code = "\n".join(line for _, line in _code_lines(path))
        for pattern in _WRITES:
            found.update(pattern.findall(code))
    return found


def test_metadata_keys_are_the_ones_the_code_writes():
    """architecture.md §2's table, the typed tags of fxmeg/ir/tags.py and the keys the code
    writes are the same keys."""
    from fxmeg.ir.tags import GRAPH_TAGS, NODE_TAGS

    rows = _table(ARCHITECTURE, "| Key | On | Written by | Read by |")
    node_doc = [m for r in rows for m in re.findall(r'^`node\.meta\["fxmeg"\]\["(\w+)"\]`$', r[0])]
    graph_doc = [m for r in rows for m in re.findall(r'^`gm\.meta\["fxmeg"\]\["(\w+)"\]`$', r[0])]
    assert len(node_doc) + len(graph_doc) == len(rows), "a row of the key table names no key"
    assert (set(node_doc), set(graph_doc)) == (set(NODE_TAGS), set(GRAPH_TAGS))
    assert set(node_doc) | set(graph_doc) == _written_keys()


def test_only_the_tags_module_touches_the_fxmeg_metadata():
    """``node.meta["fxmeg"]`` and ``gm.meta["fxmeg"]`` are read and written through
    fxmeg/ir/tags.py alone (``tag``, ``set_tag`` ...), which checks each key."""
    raw = [f"{path.relative_to(ROOT)}:{i}" for path in sorted((ROOT / "fxmeg").rglob("*.py"))
           if path != ROOT / "fxmeg" / "ir" / "tags.py"
           for i, line in _code_lines(path) if _RAW.search(line)]
    assert not raw, "raw meta['fxmeg'] outside fxmeg/ir/tags.py:\n" + "\n".join(raw)


def test_passes_that_are_not_whole_model_say_their_scope():
    for p in PASSES:
        # the module's or the function's
        doc = f"{inspect.getmodule(p.run).__doc__} {p.run.__doc__}"
        if p.scope.value == "chunk":
            assert "Scope: one chunk graph" in doc, p.name
        if p.scope.value == "parent":
            assert "Scope: the pipelined parent graph" in doc, p.name


def test_every_pass_and_check_reads_only_what_it_names():
    """A pass (and its check) names what it reads as its parameters after the graph: a
    section of the EngineConfig, ``chunk`` (per-chunk scope only), or ``config`` whole; the
    driver hands exactly those (``pass_driver.inputs``). ``config`` whole goes only to the
    passes that read several sections and the config's own fields (param_gather)."""
    from fxmeg.config import SECTIONS

    whole = set()
    for p in PASSES:
        for fn in (p.run, p.check):
            names = list(inspect.signature(fn).parameters)[1:]
            assert set(names) <= {"config", "chunk", *SECTIONS}, (p.name, fn, names)
            assert ("chunk" in names) <= (p.scope.value == "chunk"), (p.name, names)
            if "config" in names:
                whole.add(p.name)
    assert whole == {"param_gather"}
