"""The blocks of a fused projection's output, found where they are cut apart downstream,
for the tensor-parallel pass's column-parallel linears (``_TensorParallel._parts``).

A fused projection computes several values at once (Megatron's fused QKV; Mamba-2's
``in_proj``: the gate z, the convolved x, B and C, and the time steps dt) and the model
cuts its output apart later, not always at once: Mamba-2 splits it into
[z, xBC, dt] (``split_with_sizes``, sizes unequal), convolves xBC over time (a depthwise
``conv1d`` over its channels, after a transpose), then splits xBC into [x, B, C]. Each
piece is a block of the projection; split over tp, rank r holds the r-th tp-th of every
block (``fxmeg.ir.layouts.Shard``), so each rank keeps its own heads of x, its own groups of
B and C and its own time steps, and every later split cuts the local value into the
local pieces.

``split_edges`` follows a value's dim through the ops that carry each of its features to
one feature of their output (elementwise ops, casts, copies, transposes, views keeping
the dim whole, slices along other dims, a depthwise convolution over the channels) and
collects the bounds at which a split or a slice along it cuts it: the projection's
blocks are the runs between those bounds.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxmeg.passes.graph_utils import full_args, val
from fxmeg.passes.op_rules import dim_argument, in_family
from fxmeg.passes.tp.placement import dim_groups

aten = torch.ops.aten
CONVOLUTIONS = {aten.conv1d.default: 6, aten.conv2d.default: 6, aten.convolution.default: 8}
"""Convolutions and the index of their ``groups`` argument."""


def split_edges(node: fx.Node, dim: int) -> list[int]:
    """Bounds strictly inside dim ``dim`` of ``node``'s value at which a split or a slice
    along that dim cuts it, downstream through the ops that carry the dim (module
    docstring); empty when nothing cuts it."""
    size = val(node).shape[dim]
    edges: set[int] = set()
    todo, seen = [(node, dim, 0)], set()
    while todo:
        n, d, offset = todo.pop()
        if (n, d, offset) in seen:
            continue
        seen.add((n, d, offset))
        width = val(n).shape[d]
        for user in n.users:
            if in_family(user.target, "split") and dim_argument(user, 0) % val(n).dim() == d:
                starts = [0]
                for piece in user.meta["val"]:
                    starts.append(starts[-1] + piece.shape[d])
                edges.update(offset + s for s in starts)
                todo.extend(
                    (p, d, offset + starts[p.args[1]])
                    for p in user.users
                    if p.target is operator.getitem
                )
            elif user.target == aten.slice.Tensor and full_args(user)[1] % val(n).dim() == d:
                start, end, step = full_args(user)[2:5]
                start, end = slice(start, end).indices(width)[:2]
                if step == 1 and (start, end) != (0, width):
                    edges.update((offset + start, offset + end))
                    todo.append((user, d, offset + start))
                elif step == 1:
                    todo.append((user, d, offset))
            elif (carried := _carried(user, n, d)) is not None:
                todo.append((user, carried, offset))
    return sorted(e for e in edges if 0 < e < size)


def _carried(user: fx.Node, n: fx.Node, d: int) -> int | None:
    """The dim of ``user``'s output that holds dim ``d`` of its operand ``n``, feature for
    feature, or None when ``user`` mixes or reshapes that dim."""
    out = val(user)
    if not isinstance(out, torch.Tensor):
        return None
    rank_in, size = val(n).dim(), val(n).shape[d]
    if in_family(user.target, "copy", "pointwise"):
        j = d + out.dim() - rank_in
        return j if 0 <= j < out.dim() and out.shape[j] == size else None
    if in_family(user.target, "permute"):
        if user.target == aten.transpose.int:
            i, j = (a % rank_in for a in user.args[1:3])
            return {i: j, j: i}.get(d, d)
        if user.target == aten.t.default:
            return 1 - d
        return [a % rank_in for a in user.args[1]].index(d)
    if user.target == aten.slice.Tensor:  # along another dim (the caller handles this one)
        return d
    if in_family(user.target, "view") and user.target != aten.expand.default:
        for gi, gj in dim_groups(tuple(val(n).shape), tuple(out.shape)):
            ins = [i for i in gi if val(n).shape[i] != 1]
            outs = [j for j in gj if out.shape[j] != 1]
            if ins == [d]:
                return outs[0] if len(outs) == 1 else None
        return None
    if user.target in CONVOLUTIONS and user.args[0] is n and d == 1:
        groups = full_args(user)[CONVOLUTIONS[user.target]]
        depthwise = groups == size and out.shape[1] == size
        return 1 if depthwise else None
    return None
