"""The user's module and the Program keep only what this rank holds (docs/design.md §2.1).

A rank trains its own chunks' parameters, some as tensor-parallel shards. As soon as
they are made (``build_context``, before gradient buffers and optimizer state are
allocated), every other parameter (another stage's, or the full tensor of a shard)
becomes a meta tensor in the user's module and in this rank's Program, so its memory is
freed and reading it fails loudly instead of returning stale initial values. Parameters
the rank holds whole stay shared with the user's module (the Parameter objects the
engine trains); buffers and untrained state stay whole on every rank.
``Engine.full_state_dict()`` is the way to read the whole model.
"""

from __future__ import annotations

import gc

import torch
from torch import fx, nn

from fxmeg.program import Program
from fxmeg.layouts import is_split


def release(model: nn.Module, program: Program, chunks: dict[int, fx.GraphModule],
            whole: dict[str, torch.Tensor]) -> None:
    """Swap, in place in ``model`` and in ``program`` (its graphs, ``parameters``,
    ``untrained``; ``master_values`` is emptied), every tensor for what this rank keeps.

    Requires: ``chunks`` are this rank's bound chunk graphs; ``whole`` the buffers and
    untrained tensors made whole for a model built on meta (empty otherwise).
    Ensures: every parameter of ``model`` and of ``program`` is this rank's tensor (the
    one the engine trains) or a meta tensor of the full shape; buffers and untrained
    state are real and whole."""
    held = _held_whole(program, chunks)
    memo: dict[int, torch.Tensor] = {}
    for gm in (*program.chunks, program.reference):  # canonical names (the parent's are chunk_<i>.<name>)
        if gm is None:
            continue
        for name, t in gm.named_parameters():
            if id(t) not in memo:
                memo[id(t)] = held[name] if name in held else _meta(t)
        for name, t in gm.named_buffers():
            memo.setdefault(id(t), whole.get(name, t))
    canonical = {a: n for n, names in program.aliases.items() for a in names}
    for key, t in program.untrained.items():
        memo.setdefault(id(t), whole.get(canonical.get(key, key), t))
    for module in (model, program.graph, program.reference):
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


def _meta(t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        return t
    empty = torch.empty_like(t, device="meta")
    return nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty


def _swap(root: nn.Module, memo: dict[int, torch.Tensor]) -> None:
    """Replace, in every module under ``root``, each tensor ``memo`` maps (tied names too)."""
    for module in root.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and id(t) in memo:
                    table[attr] = memo[id(t)]
