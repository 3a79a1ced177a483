"""After ``parallelize``: the user's module and the Program keep only what this rank
holds (docs/design.md §2.3).

A rank trains its own chunks' parameters, some as tensor-parallel shards. Every other
parameter (another stage's, or the full tensor of a shard) becomes a meta tensor in the
user's module and in the Program, so its memory is released and reading it fails loudly
instead of returning stale initial values. Parameters the rank holds whole stay shared
with the user's module (the same Parameter objects the engine trains); buffers and
untrained state stay whole on every rank. ``Engine.full_state_dict()`` is the way to
read the whole model.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from fxmeg.program import Program, chunks
from fxmeg.runtime.context import RankContext


def release(model: nn.Module, program: Program, ctx: RankContext) -> Program:
    """The Program as this rank keeps it, with ``model`` changed to match in place.

    Requires: ``ctx`` was built from ``program`` (its chunks hold this rank's tensors).
    Ensures: every parameter of ``model`` and of the returned Program is this rank's
    tensor (the one the engine trains) or a meta tensor of the full shape; buffers and
    untrained state are real and whole."""
    held = _held_whole(program, ctx)
    memo: dict[int, torch.Tensor] = {}
    for gm in (*program.chunks, program.reference):  # canonical names (the parent's are chunk_<i>.<name>)
        if gm is None:
            continue
        for name, t in gm.named_parameters():
            if id(t) not in memo:
                memo[id(t)] = held[name] if name in held else _meta(t)
        for name, t in gm.named_buffers():
            memo.setdefault(id(t), ctx.whole.get(name, t))
    canonical = {a: n for n, names in program.aliases.items() for a in names}
    for key, t in program.untrained.items():
        memo.setdefault(id(t), ctx.whole.get(canonical.get(key, key), t))
    _swap(model, memo)
    graph = copy.deepcopy(program.graph, memo)
    return dataclasses.replace(
        program,
        graph=graph,
        chunks=tuple(chunks(graph)),
        reference=copy.deepcopy(program.reference, memo) if program.reference is not None else None,
        parameters={n: memo.get(id(p), p) for n, p in program.parameters.items()},
        master_values={},
        untrained={k: memo.get(id(t), t) for k, t in program.untrained.items()},
    )


def _held_whole(program: Program, ctx: RankContext) -> dict[str, nn.Parameter]:
    """Parameters this rank's chunks hold whole (not a tensor-parallel shard) -> the
    bound chunk's tensor."""
    out = {}
    for gm in ctx.chunks.values():
        for name, p in gm.named_parameters():
            spec = program.tp_specs.get(name)
            if spec is None or spec[0] != "shard":
                out[name] = p
    return out


def _meta(t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        return t
    empty = torch.empty_like(t, device="meta")
    return nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty


def _swap(model: nn.Module, memo: dict[int, torch.Tensor]) -> None:
    """Replace, in every module of ``model``, each tensor ``memo`` maps (tied names too)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and id(t) in memo:
                    table[attr] = memo[id(t)]
