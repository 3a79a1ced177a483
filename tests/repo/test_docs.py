"""Every command block of README.md and of the docs pages it links runs, so none can go stale.

What runs: fenced ```bash / ```sh / ```console blocks (a console block's ``$ `` lines) with
``bash -e``, and ```python blocks with ``python``. The blocks run in order, README.md first,
then the pages in the order the README first links them, in one shared working directory, as
a reader following along would: a later block may use what an earlier one made (the
checkpoint of docs/cli.md's run, the README's ``train.py``). The directory holds links to the
repository's ``models/`` and ``examples/``, a corpus at ``runs/corpus`` (made here, so a page's
blocks find data even when an earlier block did not make it), and ``fxmeg``, ``python`` and
``torchrun`` on PATH, all this interpreter. FXMEG_VERIFY is unset: the commands run as a
user runs them, and the pass checks would double their time.

Markers, an HTML comment on the line right before a block:

    <!-- docs-test: skip (REASON) -->   not run; reported as skipped with page, line and reason
    <!-- docs-test: file NAME -->       written to NAME in the working directory, not run
                                        (a later block runs it)

Not run either, and reported as skipped: the README's set-up commands (``make demo``,
``make test``: they build .venv from nothing; the suite runs inside it).

Shrinking, applied to the command text before it runs and nothing else (the page keeps its
realistic numbers); every rule must match somewhere, so a stale rule fails:

    ``--train-iters N``   -> N // 50, at least 1 (100 -> 2, 200 -> 4: a resume still trains)
    ``"n_layer": 32``     -> ``"n_layer": 8`` (docs/cli.md's plan: still pp * vpp = 8 chunks)
    ``num_hidden_layers=32`` -> ``num_hidden_layers=8`` (docs/cli.md's Mixtral plan: pp = 4)

A block whose shrunk text equals an earlier block's runs once (the README repeats docs/cli.md's
first run). Budget: about a minute on two cores; most of it is the ranks' start-up.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND_LANGS = {"bash", "sh", "console"}
SETUP_COMMANDS = {"make demo", "make test"}
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<kind>skip|file)\s*(?P<arg>.*?)\s*-->$")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")
SHRINK = [
    (re.compile(r"--train-iters (\d+)"), lambda m: f"--train-iters {max(1, int(m[1]) // 50)}"),
    (re.compile(r'"n_layer": 32'), lambda m: '"n_layer": 8'),
    (re.compile(r"num_hidden_layers=32"), lambda m: "num_hidden_layers=8"),
]


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: tuple[str, str] | None  # ("skip", "(reason)") or ("file", "NAME")

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(page: str) -> list[Block]:
    """The fenced blocks of ``page`` with the marker right before each."""
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```([\w+-]*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        indent, start = len(fence[1]), i
        i += 1
        while not re.match(r"^\s*```\s*$", lines[i]):
            i += 1
        text = "\n".join(x[indent:] for x in lines[start + 1 : i]) + "\n"
        before = lines[start - 1].strip() if start else ""
        marker = MARKER.match(before)
        where = f"{page}:{start}"
        assert marker or "docs-test" not in before, f"{where}: unreadable marker {before!r}"
        assert not marker or marker["arg"].strip("() "), (
            f"{where}: a docs-test marker needs a reason or a name"
        )
        kind = (marker["kind"], marker["arg"]) if marker else None
        out.append(Block(page, start + 1, fence[2], text, kind))
        i += 1
    return out


def local_links(page: str) -> list[str]:
    """The local files ``page`` links, in order of first link, relative to the root."""
    with open(os.path.join(ROOT, page)) as f:
        targets = LINK.findall(f.read())
    here = os.path.dirname(page)
    paths = (os.path.normpath(os.path.join(here, t)) for t in targets if "://" not in t)
    return list(dict.fromkeys(paths))


def anchors(page: str) -> list[tuple[str, str]]:
    """(file, anchor) of each local link of ``page`` with a #anchor (a bare #anchor: page)."""
    with open(os.path.join(ROOT, page)) as f:
        found = re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", f.read())
    here = os.path.dirname(page)
    return [
        (os.path.normpath(os.path.join(here, t)) if t else page, a)
        for t, a in found
        if "://" not in t
    ]


def headings(page: str) -> set[str]:
    """GitHub's anchors of the headings of ``page``: lower case, punctuation dropped,
    spaces -> -."""
    with open(os.path.join(ROOT, page)) as f:
        titles = re.findall(r"^#+ (.+)$", f.read(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


def linked_pages(page: str = "README.md") -> list[str]:
    return [p for p in local_links(page) if p.endswith(".md")]


PAGES = ["README.md", *linked_pages()]
BLOCKS = [b for page in PAGES if os.path.exists(os.path.join(ROOT, page)) for b in blocks_of(page)
          if b.lang in COMMAND_LANGS | {"python"} or (b.marker and b.marker[0] == "file")]


def commands(block: Block) -> str:
    if block.lang == "console":
        return "".join(line[2:] + "\n" for line in block.text.splitlines() if line.startswith("$ "))
    return block.text


def skip_reason(block: Block) -> str | None:
    if block.marker and block.marker[0] == "skip":
        return block.marker[1].strip("() ")
    run = {line.split("#")[0].strip() for line in commands(block).splitlines()} - {""}
    if block.lang in COMMAND_LANGS and run and run <= SETUP_COMMANDS:
        return "the set-up commands (they build .venv from nothing; the suite runs inside it)"
    return None


def shrink(text: str, used: set[int]) -> str:
    for k, (pattern, repl) in enumerate(SHRINK):
        text, n = pattern.subn(repl, text)
        if n:
            used.add(k)
    return text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The shared working directory: links to models/ and examples/, a corpus, a bin/ on PATH."""
    from fxmeg.data.corpus import prepare, read_documents
    from fxmeg.data.tokenizer import ByteTokenizer

    work = tmp_path_factory.mktemp("docs")
    for name in ("models", "examples"):
        os.symlink(os.path.join(ROOT, name), work / name)
    prepare(read_documents(["pydoc:topics"]), str(work / "runs" / "corpus"), ByteTokenizer())
    bin_dir = work / ".bin"
    bin_dir.mkdir()
    for name, run in {
        "python": "",
        "fxmeg": "-m fxmeg.train.cli",
        "torchrun": "-m torch.distributed.run",
    }.items():
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" {run} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "FXMEG_VERIFY"}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return {"dir": work, "env": env, "ran": {}}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_block(block: Block, workdir):
    reason = skip_reason(block)
    if reason:
        pytest.skip(f"{block.name} ({block.lang}) not run: {reason}")
    if block.marker and block.marker[0] == "file":
        (workdir["dir"] / block.marker[1]).write_text(shrink(block.text, set()))
        return
    text = shrink(commands(block), set())
    if text in workdir["ran"]:
        return  # the same commands ran at workdir["ran"][text]
    if block.lang == "python":
        argv = [sys.executable, "-c", text]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", text]
    out = subprocess.run(argv, cwd=workdir["dir"], env=workdir["env"], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, (f"{block.name} failed (exit {out.returncode}):\n{text}\n"
                                 f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    workdir["ran"][text] = block.name


def test_no_stale_rule():
    """A shrink rule that matches no block that runs is stale: the page changed under it."""
    used: set[int] = set()
    for b in BLOCKS:
        if not skip_reason(b):
            shrink(commands(b), used)
    stale = [pattern.pattern for k, (pattern, _) in enumerate(SHRINK) if k not in used]
    assert not stale, stale


def test_links_point_to_files():
    """Every local link of the README and of the pages it links names an existing file (and
    heading, for a #anchor), and every page under docs/ is linked from the README (so its blocks run
    here)."""
    pages = [p for p in PAGES if os.path.exists(os.path.join(ROOT, p))]
    missing = [f"{page} -> {target}" for page in pages for target in local_links(page)
               if not os.path.exists(os.path.join(ROOT, target))]
    assert not missing, missing
    broken = [f"{page} -> {path}#{anchor}" for page in pages for path, anchor in anchors(page)
              if anchor not in headings(path)]
    assert not broken, broken
    docs = {f"docs/{p}" for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md")}
    assert docs <= set(PAGES), f"not linked from README.md: {sorted(docs - set(PAGES))}"


def test_the_setup_commands_stay_in_the_readme():
    """The front page's promise: `make demo` and `make test` set up a fresh machine, each
    through the Makefile's setup (which builds .venv from nothing)."""
    setup = [b for b in blocks_of("README.md") if "set-up" in (skip_reason(b) or "")]
    assert len(setup) == 1 and "make demo" in setup[0].text and "make test" in setup[0].text
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}: setup$", makefile, re.MULTILINE), (
            f"Makefile: {target} lost setup"
        )
