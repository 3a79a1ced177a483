"""The user's module and the Program keep only what this rank holds (docs/architecture.md §2.1).

A rank trains its own chunks' parameters, some as tensor-parallel shards. As soon as
they are made (``build_context``, before gradient buffers and optimizer state are
allocated), every other parameter (another stage's, or the full tensor of a shard)
becomes a meta tensor in this rank's Program and a ``Released`` placeholder in the user's
module, so its memory is freed and reading it raises ``ReleasedError``, naming the
parameter and ``Engine.full_state_dict()``, instead of returning stale initial values.
Parameters the rank holds whole stay shared with the user's module (the Parameter
objects the engine trains), except at zero=3, whose parameters are views of memory freed
between uses (reading one would read freed memory: a segfault): those are placeholders
too. Buffers and untrained state stay whole on every rank.
``Engine.full_state_dict()`` is the way to read the whole model.
"""

from __future__ import annotations

import gc

import torch
from torch import fx, nn

from fxmeg.errors import ReleasedError
from fxmeg.ir.layouts import is_split
from fxmeg.ir.program import Program
from fxmeg.torch_private import DisableTorchFunctionSubclass, own_buffers, own_parameters

_METADATA = frozenset(
    {
        torch.Tensor.shape,
        torch.Tensor.dtype,
        torch.Tensor.device,
        torch.Tensor.requires_grad,
        torch.Tensor.grad,
        torch.Tensor.is_meta,
        torch.Tensor.ndim,
        torch.Tensor.is_leaf,
        torch.Tensor.layout,
        torch.Tensor.is_cuda,
        torch.Tensor.is_sparse,
        torch.Tensor.is_quantized,
    }
)
"""Tensor properties a placeholder answers (its getters reach ``__torch_function__``)."""
_METHODS = frozenset({"numel", "nelement", "dim", "size", "element_size", "__len__"})
"""... and methods: what counting parameters and shapes reads."""


class Released(nn.Parameter):
    """Stands, in the user's module, for a parameter this rank does not hold readable: a
    meta tensor of the full shape that answers shape, dtype and device questions (so
    ``sum(p.numel() for p in model.parameters())`` counts the model) and raises
    ``ReleasedError`` on anything that reads values (``norm``, ``state_dict``, ``print``)."""

    def __new__(cls, like: torch.Tensor, name: str, why: str, aliases=()) -> Released:
        out = super().__new__(cls, torch.empty_like(like, device="meta"), like.requires_grad)
        tied = [a for a in aliases if a != name]
        out.fxmeg_name = repr(name) + (f" (tied: {', '.join(map(repr, tied))})" if tied else "")
        out.fxmeg_why = why
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if (
            getattr(func, "__self__", None) in _METADATA
            or getattr(func, "__name__", "") in _METHODS
        ):
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        held = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Released))
        raise ReleasedError(
            f"parameter {held.fxmeg_name} of the model passed to parallelize is not readable on "
            f"this rank: {held.fxmeg_why}. Read the trained model with engine.full_state_dict() "
            "(collective: call it on every rank); this rank's own tensors are "
            "engine.named_parameters"
        )


def release(model: nn.Module, program: Program, chunks: dict[int, fx.GraphModule],
            whole: dict[str, torch.Tensor]) -> None:
    """Swap, in place in ``model`` and in ``program`` (its graphs, ``parameters``,
    ``untrained``; ``master_values`` is emptied), every tensor for what this rank keeps.

    Requires: ``chunks`` are this rank's bound chunk graphs; ``whole`` the buffers and
    untrained tensors made whole for a model built on meta (empty otherwise).
    Ensures: every parameter of ``program`` is this rank's tensor (the one the engine
    trains) or a meta tensor of the full shape; every parameter of ``model`` is this rank's
    tensor where it holds it readable, else a ``Released`` placeholder; buffers and
    untrained state are real and whole."""
    held = _held_whole(program, chunks)
    # zero=3: views of memory freed between uses (an expert bank's too: its buffer over the
    # expert-data-parallel ranks); at other stages a bank holds this rank's experts only
    zero3 = program.config.data_parallel.zero_stage == 3
    readable = {} if zero3 else {n: t for n, t in held.items() if n not in program.ep_specs}
    memo: dict[int, torch.Tensor] = {}
    mine: dict[int, torch.Tensor] = {}  # the user's module's
    # canonical names (the parent's are chunk_<i>.<name>)
    for gm in (*program.chunks, program.reference):
        if gm is None:
            continue
        for name, t in gm.named_parameters():
            if id(t) not in memo:
                memo[id(t)] = held[name] if name in held else _meta(t)
                mine[id(t)] = (
                    readable[name]
                    if name in readable
                    else Released(
                        t, name, _why(program, chunks, name), program.aliases.get(name, ())
                    )
                )
        for name, t in gm.named_buffers():
            memo.setdefault(id(t), whole.get(name, t))
    canonical = {a: n for n, names in program.aliases.items() for a in names}
    for key, t in program.untrained.items():
        memo.setdefault(id(t), whole.get(canonical.get(key, key), t))
    _swap(model, mine | {i: t for i, t in memo.items() if i not in mine})
    for module in (program.graph, program.reference):
        if module is not None:
            _swap(module, memo)
    for table in (program.parameters, program.untrained):
        for key, t in table.items():
            table[key] = memo.get(id(t), t)
    program.master_values.clear()
    # torch.export's program, garbage in reference cycles, still holds the model's
    # tensors: collect it now, so their memory is free before gradient buffers and
    # optimizer state are allocated
    gc.collect()


def _held_whole(program: Program, chunks: dict[int, fx.GraphModule]) -> dict[str, nn.Parameter]:
    """Parameters this rank's chunks hold whole (not a tensor-parallel shard) -> the
    bound chunk's tensor."""
    out = {}
    for gm in chunks.values():
        for name, p in gm.named_parameters():
            if not is_split(program.tp_specs.get(name)):
                out[name] = p
    return out


def _why(program: Program, chunks: dict[int, fx.GraphModule], name: str) -> str:
    """Why this rank does not hold parameter ``name`` readable, for ``ReleasedError``."""
    par = program.config.parallel
    stages = program.holders.get(name, ())
    if not {program.placement[c] for c in chunks} & set(stages):
        where = (
            f"pipeline rank {stages[0]}" if len(stages) == 1 else f"pipeline ranks {list(stages)}"
        )
        return f"{where} of pp={par.pp} trains it, not this one"
    if program.config.data_parallel.zero_stage == 3 and name in program.ep_specs:
        return (
            f"zero=3 keeps only this rank's share of it between steps (1/{par.edp} of its "
            f"experts' rows at ep={par.ep}), gathered while a step reads it (docs/zero.md)"
        )
    if program.config.data_parallel.zero_stage == 3:
        return (
            f"zero=3 keeps only this rank's 1/{par.dp * par.cp} of it between steps, gathered "
            "while a step reads it (docs/zero.md)"
        )
    if name in program.ep_specs:
        return f"this rank holds its experts' rows of it (ep={par.ep})"
    return f"this rank holds its tensor-parallel shard of it (tp={par.tp})"


def _meta(t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        return t
    empty = torch.empty_like(t, device="meta")
    return (
        nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    )


def _swap(root: nn.Module, memo: dict[int, torch.Tensor]) -> None:
    """Replace, in every module under ``root``, each tensor ``memo`` maps (tied names too)."""
    for module in root.modules():
        for table in (own_parameters(module), own_buffers(module)):
            for attr, t in table.items():
                if t is not None and id(t) in memo:
                    table[attr] = memo[id(t)]
