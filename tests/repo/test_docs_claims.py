"""What the docs claim, held to the repository, so a claim cannot go stale silently
(tests/repo/test_docs.py runs the docs' command blocks; this checks the rest, in one process,
reading files only: no ranks, no training).

* The README's "What is supported" table: every item of a "not yet" cell names the
  docs/errors.md row that refuses it (``[`row`](docs/errors.md)``), the row exists, and the
  refusal exists in code (tests/repo/test_errors.py runs the row, or its message excerpt is in
  fxmeg/'s sources); every item of a "supported" cell names a test that runs it
  (```tests/FILE.py``` or ```tests/FILE.py::TEST```), the file and the test exist, and that
  test uses what the item names in code spans (an option, a flag, a value): one cited test's
  code (its source unparsed: no comments, no docstrings) contains every word of the span, a
  hyphen read as an underscore (``--eod-mask-loss`` is the field ``eod_mask_loss``). Each
  value of an enumerated option (CHOICES: ``cp_comm_type``'s) is named in its row's
  supported cell, so an option that ships cannot be left out or called missing there.
* Paths: every repository path named in README.md, docs/*.md (text and relative links,
  their #anchors included) and in the docstrings and comments of fxmeg/ exists, and so
  does every test a pytest id names (``tests/FILE.py::TEST``).
* Maps: docs/contributing.md lists every module under fxmeg/ (and only those), and
  docs/architecture.md §7 every folder.
* Module docstrings stay short: at most DOCSTRING_LINES lines; rationale goes to docs/.
* ``fxmeg prepare-data`` takes Megatron's ``--tokenizer-model``, as ``fxmeg train`` does.
"""

from __future__ import annotations

import ast
import glob
import io
import os
import re
import tokenize

import pytest

from fxmeg.config import CP_COMM_TYPES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
SOURCES = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "fxmeg", "**", "*.py"), recursive=True)
)

TOP = ("fxmeg", "docs", "tests", "bench", "tools", "examples", "models")
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(TOP)})/[\w./-]*)")
"""A repository path: a top-level folder, then anything path-like (a folder ends in /)."""
PACKAGE_PATH = re.compile(
    r"(?<![\w/.-])((?:runtime|passes|data|frontend|ir|weights|interop|train|diagnostics)/[\w/-]+\.py)\b"
)
"""A module named relative to fxmeg/ (``runtime/step.py``), as the docs and docstrings do."""
FOREIGN = {"tools/preprocess_data.py": "Megatron-LM's, named where fxmeg reads what it writes"}
"""Paths of other projects that look like this repository's, and whose they are."""
LINK = re.compile(r"\]\(([^)\s]+)\)")
ROW_LINK = re.compile(r"\[`([a-z0-9-]+)`\]\(docs/errors\.md\)")
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")
TEST_ID = re.compile(r"(tests/[\w/]+\.py)(?:::\w+)*::(\w+)")
"""A pytest id, ``tests/FILE.py::TEST`` or ``tests/FILE.py::Class::test``: the test must exist."""
SPAN = re.compile(r"`([^`]+)`")
WORD = re.compile(r"\w[\w+-]*")
"""A word of a code span or of code: ``cp_comm_type``, ``a2a+p2p``, ``eod-mask-loss``."""
CHOICES = {"context parallelism": ("cp_comm_type", CP_COMM_TYPES)}
"""README row -> an option whose every value fxmeg accepts, read from fxmeg: the row names each."""


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _exists(path: str) -> bool:
    return os.path.exists(os.path.join(ROOT, path))


# --- the README's support table ---------------------------------------------------------


def _support_table() -> list[tuple[str, str, str]]:
    """(area, supported cell, not-yet cell) of each row of the README's table."""
    text = _read("README.md").split("## What is supported", 1)[1].split("\n## ", 1)[0]
    rows = [
        line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| |")
    ]
    cells = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in rows]
    assert cells and all(len(c) == 3 for c in cells), (
        "the table has three columns: area, supported, not yet"
    )
    return [tuple(c) for c in cells]


def _items(cell: str) -> list[str]:
    """A cell's items: its parts between '; ' outside parentheses and backticks."""
    items, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(cell):
        quoted ^= ch == "`"
        depth += (ch == "(") - (ch == ")") if not quoted else 0
        if cell.startswith("; ", i) and depth == 0 and not quoted:
            items.append(cell[start:i])
            start = i + 2
    items.append(cell[start:])
    return [item.strip() for item in items if item.strip()]


def _error_rows() -> dict[str, str]:
    """Every row of docs/errors.md's tables -> its message excerpt."""
    rows = {}
    for line in _read("docs/errors.md").splitlines():
        m = re.match(r"^\| `([a-z0-9-]+)` \|(.*)$", line)
        if m:
            cells = m[2].split(" | ")
            rows[m[1]] = cells[1].strip(" `") if len(cells) > 1 else ""
    return rows


def _tested_rows() -> set[str]:
    """The rows tests/repo/test_errors.py runs: the keys of ROWS and SET_UP
    (tests/repo/refusals.py)."""
    tree = ast.parse(_read("tests/repo/refusals.py"))
    keys = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) in ("ROWS", "SET_UP") for t in node.targets
        ):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return keys


def _in_sources(excerpt: str) -> bool:
    """Whether a literal run of the message excerpt (20 characters or more between the
    values a message interpolates) is in fxmeg/'s sources."""
    code = "".join(_read(p) for p in SOURCES)
    fragments = re.split(r"\.\.\.|'[^']*'|\d+|`", excerpt)
    return any(len(f.strip()) >= 20 and f.strip() in code for f in fragments)


CELLS = _support_table()


@pytest.mark.parametrize(
    "area, cell", [(a, n) for a, _, n in CELLS if n], ids=[a for a, _, n in CELLS if n]
)
def test_each_not_yet_names_a_refusal_that_exists(area, cell):
    documented, tested = _error_rows(), _tested_rows()
    for item in _items(cell):
        rows = ROW_LINK.findall(item)
        assert rows, (
            f"README.md, {area}, not yet: {item!r} names no refusal row: add "
            "([`row`](docs/errors.md))"
        )
        for row in rows:
            assert row in documented, (
                f"README.md, {area}: {item!r} names row {row!r}, which docs/errors.md lacks"
            )
            assert row in tested or _in_sources(documented[row]), (
                f"README.md, {area}: row {row!r} is neither run by tests/repo/test_errors.py nor "
                f"is its message {documented[row]!r} in fxmeg/'s sources"
            )


def _test(path: str, name: str | None) -> ast.AST | None:
    """The parsed file, or its function ``name``; None where either is gone."""
    if not _exists(path):
        return None
    tree = ast.parse(_read(path))
    if name is None:
        return tree
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    functions = (n for n in ast.walk(tree) if isinstance(n, defs))
    return next((n for n in functions if n.name == name), None)


def _test_exists(path: str, name: str | None) -> bool:
    return _test(path, name) is not None


class _NoDocstrings(ast.NodeTransformer):
    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return ast.Pass()
        return node


def _code(path: str, name: str | None) -> str:
    """A test's code as words are looked up in it: unparsed (comments gone), its docstrings
    (every bare string statement) gone, hyphens read as underscores."""
    return ast.unparse(_NoDocstrings().visit(_test(path, name))).replace("-", "_")


def _words(span: str) -> list[str]:
    return [w.replace("-", "_") for w in WORD.findall(span)]


@pytest.mark.parametrize("area, cell", [(a, s) for a, s, _ in CELLS], ids=[a for a, _, _ in CELLS])
def test_each_supported_item_names_a_test_that_runs_it(area, cell):
    for item in _items(cell):
        refs = TEST_REF.findall(item)
        assert refs, (
            f"README.md, {area}, supported: {item!r} names no test: add (`tests/FILE.py[::TEST]`)"
        )
        for path, name in refs:
            assert _test_exists(path, name or None), (
                f"README.md, {area}: {item!r} names {path}::{name}, which is gone"
            )
        codes = [_code(path, name or None) for path, name in refs]
        for span in SPAN.findall(item):
            if not span.startswith("tests/"):
                assert any(all(w in code for w in _words(span)) for code in codes), (
                    f"README.md, {area}: {item!r} names `{span}`, which no test it cites uses "
                    f"({', '.join('::'.join(filter(None, r)) for r in refs)}): cite one that does"
                )


@pytest.mark.parametrize("area", sorted(CHOICES))
def test_each_value_of_an_option_is_in_its_row(area):
    option, values = CHOICES[area]
    supported = next(s for a, s, _ in CELLS if a == area)
    named = {w for span in SPAN.findall(supported) for w in WORD.findall(span)}
    missing = [v for v in values if v not in named]
    assert not missing, (
        f"README.md, {area}: fxmeg takes {option}={missing} but the supported cell does not "
        f"name {'it' if len(missing) == 1 else 'them'} in a code span: add each, with its test"
    )


# --- paths ------------------------------------------------------------------------------


def _missing(path: str, *, package_relative: bool = False) -> bool:
    path = path.rstrip(".,:;")
    if path in FOREIGN:
        return False
    return not (_exists(path) or (package_relative and _exists(os.path.join("fxmeg", path))))


def _stale_in(where: str, lineno: int, line: str) -> list[str]:
    out = [f"{where}:{lineno}: {p}" for p in PATH.findall(line) if _missing(p)]
    out += [
        f"{where}:{lineno}: {p}::{t} (no such test)"
        for p, t in TEST_ID.findall(line)
        if not _test_exists(p, t)
    ]
    out += [
        f"{where}:{lineno}: {p}"
        for p in PACKAGE_PATH.findall(line)
        if _missing(p, package_relative=True)
    ]
    return out


def _anchors(page: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
    heads = re.findall(r"^#+\s+(.*)$", _read(page), flags=re.MULTILINE)
    return {
        re.sub(r"[^\w\- ]", "", h.replace("`", "")).strip().lower().replace(" ", "-") for h in heads
    }


def _stale_link(page: str, target: str) -> str | None:
    if re.match(r"^[a-z]+:", target) or target.startswith("#") and not target[1:]:
        return None  # a URL
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not _exists(full):
        return target
    if anchor and full.endswith(".md") and anchor not in _anchors(full):
        return f"{target} (no heading with that anchor)"
    return None


def test_paths_named_in_the_docs_exist():
    stale = []
    for page in PAGES:
        for lineno, line in enumerate(_read(page).splitlines(), 1):
            stale += _stale_in(page, lineno, line)
            stale += [
                f"{page}:{lineno}: link {bad}"
                for t in LINK.findall(line)
                if (bad := _stale_link(page, t))
            ]
    assert not stale, "paths that do not exist:\n" + "\n".join(stale)


def _docstrings_and_comments(source: str) -> list[tuple[int, str]]:
    """(line number, text) of each line of a docstring (any string statement: module,
    class, function and attribute docstrings) and of each comment."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out += [(n, lines[n - 1]) for n in range(node.lineno, node.end_lineno + 1)]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def test_paths_named_in_docstrings_and_comments_exist():
    stale = []
    for path in SOURCES:
        for lineno, text in _docstrings_and_comments(_read(path)):
            stale += _stale_in(path, lineno, text)
    assert not stale, "paths that do not exist:\n" + "\n".join(stale)


# --- folder maps ------------------------------------------------------------------------


def _map_block(page: str, start: str) -> list[str]:
    """The lines of the first fenced block of ``page`` after the line starting ``start``."""
    text = _read(page)
    text = text[text.index(start):]
    return text.split("```\n", 2)[1].splitlines()


def test_the_module_map_lists_every_module():
    block = _map_block("docs/contributing.md", "Every module under `fxmeg/`")
    listed = [line.split()[0] for line in block if line.strip()]
    modules = [m for m in listed if m.startswith("fxmeg/")]
    files = {p for p in SOURCES if os.path.basename(p) != "__init__.py"}
    assert not sorted(files - set(modules)), (
        f"docs/contributing.md's map lacks {sorted(files - set(modules))}"
    )
    assert not sorted(set(modules) - files), (
        f"docs/contributing.md's map lists {sorted(set(modules) - files)}"
    )
    assert len(modules) == len(set(modules)), "a module listed twice"
    assert all(_exists(p) for p in listed), [p for p in listed if not _exists(p)]


def test_the_folder_map_lists_every_folder():
    block = _map_block("docs/architecture.md", "## 7. Layout of folders")
    # continuation lines are indented
    listed = {line.split()[0] for line in block if line[:1].strip()}
    packages = glob.glob(os.path.join(ROOT, "fxmeg", "*", "__init__.py"))
    folders = {f"{d}/" for d in TOP} | {
        os.path.relpath(os.path.dirname(p), ROOT) + "/" for p in packages
    }
    assert folders <= listed, f"docs/architecture.md §7 lacks {sorted(folders - listed)}"
    assert all(_exists(p) for p in listed), [p for p in listed if not _exists(p)]


# --- short module docstrings -----------------------------------------------------------

DOCSTRING_LINES = 30
"""A module docstring says what the module is for and what it guarantees (a pass's Requires /
Ensures included: those keep pipeline.py, buckets.py and expert_parallel.py near the limit);
rationale, history and comparisons go to docs/ (docs/architecture.md §8) behind a pointer."""
LONG_DOCSTRING_EXEMPT: set[str] = set()
"""Modules allowed a longer docstring, each with the reason (none today)."""


def _module_docstring_lines(path: str) -> int:
    doc = ast.get_docstring(ast.parse(_read(path))) or ""
    return len(doc.splitlines())


def test_module_docstrings_are_short():
    long = [f"{p}: {n} lines" for p in SOURCES if p not in LONG_DOCSTRING_EXEMPT
            and (n := _module_docstring_lines(p)) > DOCSTRING_LINES]
    assert not long, (f"module docstrings over {DOCSTRING_LINES} lines (move the rationale "
                      "to docs/, leave a pointer):\n" + "\n".join(long))


# --- flags named alike across subcommands ----------------------------------------------


def test_prepare_data_takes_megatrons_tokenizer_flag():
    import argparse

    from fxmeg.train.cli import _prepare_parser

    parser = argparse.ArgumentParser()
    _prepare_parser(parser)
    base = ["--input", "a.txt", "--output", "runs/c"]
    assert parser.parse_args(base + ["--tokenizer-model", "tok.json"]).tokenizer == "tok.json"
    # the earlier name
    assert parser.parse_args(base + ["--tokenizer", "tok.json"]).tokenizer == "tok.json"
    assert parser.parse_args(base).tokenizer == "bytes"
    for page in ("README.md", "docs/cli.md"):
        assert not re.search(r"prepare-data[^\n]*--tokenizer(?![-\w])", _read(page)), (
            f"{page} names --tokenizer"
        )
