"""fxmeg/torch_private.py, the one home of fxmeg's private torch names.

(a) Every entry resolves on the installed torch: each ``_private("module:attr")`` path
in the shim (the ones resolved on first call too), and each attribute read the shim
wraps, tried on a small object. A moved name fails naming the entry, the installed
torch and CHECKED_ON.
(b) No other module of fxmeg/ reads a private torch name (source scan with ``ast``): an
import of a ``_``-led torch module or name, an attribute chain rooted at a torch import
with a ``_``-led link (``torch._C``, ``nn.utils.stateless._x``, ``dist._x``; not op
names in the public ``torch.ops.<namespace>``), ``getattr(torch..., "_x")``, and a read
of a private attribute some torch object has (``node.target._schema``, ``t._base``,
``module._parameters``, but not ``self._x``; the names come from ``dir()`` of sample
torch objects). The scanner is pinned on a synthetic file.
"""

from __future__ import annotations

import ast
import importlib
import textwrap
from pathlib import Path

import torch
from torch import fx, nn

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "fxmeg" / "torch_private.py"


# ---------------------------------------------------------------- (a) entries resolve
# Read from the shim's source, not imported: a moved name fails the shim's import, and
# this test must still say which entry it is.


def _checked_on() -> str:
    tree = ast.parse(SHIM.read_text())
    return next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "CHECKED_ON" for t in node.targets))


def _paths_by_entry() -> dict[str, str]:
    """Entry name -> the "module:attr" path it resolves, for every ``_private("...")``
    in the shim (an assignment's target, or the function that calls it)."""
    found = {}
    for top in ast.parse(SHIM.read_text()).body:
        names = (
            [t.id for t in top.targets if isinstance(t, ast.Name)]
            if isinstance(top, ast.Assign)
            else [top.name]
            if isinstance(top, ast.FunctionDef)
            else []
        )
        for node in ast.walk(top):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "_private"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found[names[0] if names else "?"] = node.args[0].value
    return found


def _resolve(path: str) -> object:
    module, _, attrs = path.partition(":")
    obj = importlib.import_module(module)
    for name in attrs.split("."):
        obj = getattr(obj, name)
    return obj


def _attribute_checks(tp) -> dict:
    """The entries of the shim ``tp`` that read an attribute of an object (no path to
    import), each with a check on a small object."""
    x = torch.arange(6.0)
    view = x.view(2, 3)
    linear, norm = nn.Linear(2, 2), nn.BatchNorm1d(2)
    return {
        "op_schema": lambda: (
            tp.op_schema(torch.ops.aten.add.Tensor).name == "aten::add"
            and tp.op_schema(len) is None
        ),
        "view_base": lambda: tp.view_base(view) is x and tp.view_base(x) is None,
        "storage_key": lambda: (
            tp.storage_key(view) == tp.storage_key(x) != tp.storage_key(x.clone())
        ),
        "own_parameters": lambda: sorted(tp.own_parameters(linear)) == ["bias", "weight"],
        "own_buffers": lambda: (
            "running_mean" in tp.own_buffers(norm) and not tp.own_buffers(linear)
        ),
        # torch.distributed.nn's collectives still take their group as a default argument,
        # which the release leaves None (no process group here: it must run all the same)
        "release_world_capture": lambda: (
            tp.release_world_capture() is None
            and _group_defaults() and all(d is None for d in _group_defaults())
        ),
    }


def _group_defaults() -> list:
    import inspect

    import torch.distributed.nn.functional as functional

    return [inspect.signature(f).parameters["group"].default
            for f in (functional.all_reduce, functional.all_gather, functional.broadcast,
                      functional.all_to_all_single)]


def test_every_entry_resolves_on_the_installed_torch():
    failed = []
    for entry, path in _paths_by_entry().items():
        try:
            _resolve(path)
        except (ImportError, AttributeError) as exc:
            failed.append(f"torch_private.{entry} ({path}): {type(exc).__name__}: {exc}")
    try:
        checks = _attribute_checks(importlib.import_module("fxmeg.torch_private")).items()
    except ImportError:
        checks = ()
        failed.append("(the attribute entries were not tried: fxmeg.torch_private does not import)")
    for entry, check in checks:
        try:
            ok, why = check(), "returned the wrong thing"
        except Exception as exc:  # a renamed attribute: AttributeError, or anything else
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            failed.append(f"torch_private.{entry}: {why}")
    assert not failed, (
        f"private torch names fxmeg uses that torch {torch.__version__} does not have "
        f"(fxmeg/torch_private.py was checked on torch {_checked_on()}):\n  " + "\n  ".join(failed)
    )


def test_every_public_name_of_the_shim_is_checked():
    """A new entry needs a ``_private`` path or an attribute check above."""
    tree = ast.parse(SHIM.read_text())
    public = {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    } | {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    public = {n for n in public if not n.startswith("_")} - {"CHECKED_ON"}
    unchecked = public - set(_paths_by_entry()) - set(_attribute_checks(tp=None))
    assert not unchecked, f"entries of fxmeg/torch_private.py no test resolves: {sorted(unchecked)}"


def test_a_moved_name_raises_naming_it_and_the_checked_version():
    from fxmeg import torch_private

    try:
        torch_private._private("torch._guards:no_such_thing")
    except ImportError as exc:
        assert "torch._guards.no_such_thing" in str(exc) and torch_private.CHECKED_ON in str(exc)
    else:
        raise AssertionError("a missing name resolved")


# ---------------------------------------------------------------- (b) the source scan


def _torch_private_attributes() -> frozenset[str]:
    """``_``-led attribute names that torch objects fxmeg handles carry (not dunders)."""
    gm = fx.symbolic_trace(nn.Linear(2, 2))
    samples = [
        torch.zeros(2),
        torch.zeros(2).untyped_storage(),
        nn.Linear(2, 2),
        nn.Parameter(torch.zeros(2)),
        gm,
        gm.graph,
        next(iter(gm.graph.nodes)),
        torch.ops.aten.add.Tensor,
        torch.ops.aten.add,
        torch.autograd.Variable,
        torch.ops.higher_order.wrap_with_autocast,
    ]
    return frozenset(
        n for obj in samples for n in dir(obj) if n.startswith("_") and not n.startswith("__")
    )


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None when the root is not a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _torch_names(tree: ast.AST) -> set[str]:
    """Local names a file binds to torch or to something imported from it."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {
                a.asname or a.name.split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == "torch"
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "torch"
            and not node.level
        ):
            bound |= {a.asname or a.name for a in node.names}
    return bound


def _offences(tree: ast.AST, attributes: frozenset[str]) -> list[tuple[int, str]]:
    """(line, what) for each private torch name ``tree`` reads."""
    torch_names, found = _torch_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "torch"
            and not node.level
        ):
            names = [a.name for a in node.names]
            if any(map(_private, node.module.split("."))) or any(map(_private, names)):
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _chain(node)
            rooted = chain is not None and chain[0] in torch_names
            in_ops = rooted and "ops" in chain and chain.index("ops") < len(chain) - 2 \
                and not _private(chain[chain.index("ops") + 1])  # torch.ops.aten._to_copy: public
            if (rooted and not in_ops) or (
                node.attr in attributes and (chain or [""])[0] not in ("self", "cls")
            ):
                found.append((node.lineno, ".".join(chain) if chain else f"(...).{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            chain = _chain(node.args[0])
            if (chain is not None and chain[0] in torch_names) or node.args[1].value in attributes:
                found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(set(found))


def _scan(root: Path, *, skip: Path | None, attributes: frozenset[str]) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        if path != skip:
            out += [f"{path.relative_to(root.parent)}:{line}: {what}"
                    for line, what in _offences(ast.parse(path.read_text(), str(path)), attributes)]
    return out


def test_no_module_but_the_shim_reads_a_private_torch_name():
    offenders = _scan(REPO / "fxmeg", skip=SHIM, attributes=_torch_private_attributes())
    assert not offenders, (
        "private torch names read outside fxmeg/torch_private.py; add an entry there and import it "
        "(docs/contributing.md, 'Private torch APIs'):\n  " + "\n  ".join(offenders))


def test_the_scan_finds_each_kind_of_read(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(textwrap.dedent('''
        import torch
        import torch._dynamo
        import torch.distributed.distributed_c10d as c10d
        from torch import nn
        from torch._guards import detect_fake_mode
        from torch.utils import _pytree

        aten = torch.ops.aten
        ok = (torch.ops.aten._to_copy.default, aten._softmax, torch.__version__, nn.Linear)

        def f(node, t, module):
            torch._foreach_norm([t])
            c10d._resolve_process_group("g")
            nn.utils.stateless._reparametrize_module
            node.target._schema
            t.untyped_storage()._cdata
            getattr(node.target, "_schema", None)
            getattr(torch, "_C")
            module._parameters
            self._mine
    '''))
    attributes = frozenset({"_schema", "_cdata", "_parameters"})
    lines = [
        int(o.split(":")[1]) for o in _scan(tmp_path / "pkg", skip=None, attributes=attributes)
    ]
    assert lines == [3, 6, 7, 13, 14, 15, 16, 17, 18, 19, 20], lines
