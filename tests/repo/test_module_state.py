"""No mutable module-level state in fxmeg/ (STYLE: "nothing is global"; live state belongs
to the RankContext, the Engine or an object passed explicitly). An ast scan names each
offender as file:line:

- a module-level container (dict / list / set, literal, comprehension or constructor) whose
  name is not a CONSTANT_NAME (a constant table is spelt in capitals, and never written);
- any module-level name written after its definition (``X[k] = v``, ``X.append(...)``,
  ``X += ...``, ``del X[k]``), and any ``global`` statement;
- a class attribute written through the class (``Cls.count += 1``): state shared by every
  instance, module state in disguise.
"""

import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
_CONSTRUCTORS = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "deque",
    "Counter",
    "bytearray",
}
_MUTATORS = {
    "append",
    "add",
    "update",
    "setdefault",
    "pop",
    "popitem",
    "clear",
    "extend",
    "insert",
    "remove",
    "discard",
    "appendleft",
    "__setitem__",
}


def _is_container(value: ast.expr | None) -> bool:
    if isinstance(value, _CONTAINERS):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")) in _CONSTRUCTORS
    return False


def _constant_name(name: str) -> bool:
    bare = name.strip("_")
    return name == "__all__" or (bare.isupper() or not bare.strip("0123456789_"))


def _written(node: ast.AST) -> str | None:
    """The name a statement or call writes into (X[k] = ..., X.append(...), X += ...)."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for t in targets:
            if isinstance(node, ast.AugAssign) and isinstance(t, ast.Name):
                return t.id
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                return t.value.id
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _MUTATORS
        and isinstance(node.func.value, ast.Name)
    ):
        return node.func.value.id
    return None


def offenders(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    found = []
    top: set[str] = set()
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    for n in tree.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Name):
                    top.add(t.id)
                    if _is_container(n.value) and not _constant_name(t.id):
                        found.append(f"{where}:{n.lineno} module-level container {t.id!r}")
    shadowed = {a.arg for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.Lambda))
                for a in f.args.args + f.args.kwonlyargs}
    for n in ast.walk(tree):
        if isinstance(n, ast.Global):
            found.append(f"{where}:{n.lineno} global {', '.join(n.names)}")
        name = _written(n)
        if name in top and name not in shadowed:
            found.append(f"{where}:{n.lineno} module-level {name!r} written")
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id in classes
                ):
                    found.append(f"{where}:{n.lineno} class attribute {ast.unparse(t)} written")
    return found


ALLOWED = {
    # the @rule registry: filled at import, then read only
    "fxmeg/passes/op_rules.py": ("'_RULES' written",),
}


def test_fxmeg_has_no_module_level_mutable_state():
    found = [o for p in sorted((REPO / "fxmeg").rglob("*.py"))
             for o in offenders(p.read_text(), str(p.relative_to(REPO)))
             if not o.endswith(ALLOWED.get(str(p.relative_to(REPO)), ()))]
    assert not found, (
        "module-level mutable state (move it to an object the RankContext or Engine owns):\n  "
        + "\n  ".join(found)
    )


def test_the_scan_finds_each_kind_and_spares_constant_tables():
    source = textwrap.dedent('''
        TABLE = {"a": 1}
        _NAMES = [x for x in "ab"]
        cache = {}
        _seen: set = set()
        _CACHE = {}

        class C:
            depth = 0
            def enter(self):
                C.depth += 1

        def f(k, cache):
            global counter
            _CACHE[k] = 1
            _seen.add(k)
            cache[k] = 2  # a parameter, not the module's
            return TABLE[k]
    ''')
    got = [o.split(" ", 1)[1] for o in offenders(source, "m.py")]
    assert sorted(got) == sorted(
        [
            "module-level container 'cache'",
            "module-level container '_seen'",
            "class attribute C.depth written",
            "global counter",
            "module-level '_CACHE' written",
            "module-level '_seen' written",
        ]
    ), got
