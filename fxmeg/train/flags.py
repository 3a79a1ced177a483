"""The flags of `fxmeg train`, `fxmeg verify` and `fxmeg plan`: one per flat option name (its
help the field's docstring), Megatron-LM's names beside them, and a --config file read.
Imports no torch: `fxmeg --help` answers without it."""

from __future__ import annotations

import argparse

WORDS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
"""Options given as several words (flags with nargs='+'), kept as one space-separated string."""


def flags(p: argparse.ArgumentParser, names, defaults: dict[str, str] | None = None) -> None:
    """One flag per flat name (default None: not given), its help the field's docstring and
    the default (as ``defaults`` says it where the command's own differs)."""
    from fxmeg.train.train_config import flat_defaults, flat_fields

    fields_default, fields = flat_defaults(), flat_fields()
    docs = {cls: _field_docs(cls) for cls, _ in fields.values()}
    for name in names:
        (cls, kind), flag = fields[name], "--" + name.replace("_", "-")
        doc = docs[cls].get(name, "")
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=doc)
        elif name in WORDS:  # --data-path 0.3 A 0.7 B, as Megatron's
            p.add_argument(flag, nargs="+", default=None, metavar="WORD", help=doc)
        else:
            said = (defaults or {}).get(name, repr(fields_default[name]))
            p.add_argument(flag, type=kind, default=None, help=f"{doc} (default {said})")
    _megatron_flags(p, names)


def _megatron_flags(p: argparse.ArgumentParser, names) -> None:
    """Megatron-LM's flag for each of ``names`` that has one (train_config.MEGATRON_NAMES),
    setting the same option: --tensor-model-parallel-size 2 is --tp 2, --bf16 is
    --precision bf16."""
    from fxmeg.train.train_config import MEGATRON_NAMES, flat_fields

    group = p.add_argument_group("Megatron-LM's names (each sets the fxmeg option named)")
    fields = flat_fields()
    for alias, (name, switch) in MEGATRON_NAMES.items():
        if name not in names:
            continue
        flag, target = "--" + alias.replace("_", "-"), "--" + name.replace("_", "-")
        if switch is None:
            group.add_argument(
                flag,
                dest=alias,
                type=fields[name][1],
                default=None,
                metavar="VALUE",
                help=f"{target}",
            )
        else:
            group.add_argument(flag, dest=alias, action="store_const", const=True, default=None,
                               help=f"{target} {switch}" if switch is not True else target)


def _field_docs(cls) -> dict[str, str]:
    """The one-line docstrings under each dataclass field."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
        ):
            docs[a.target.id] = " ".join(b.value.value.split()).replace("%", "%%")
    return docs


def read_config(path: str) -> dict:
    if path.endswith((".yaml", ".yml")):
        import yaml

        with open(path) as f:
            return yaml.safe_load(f) or {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)
