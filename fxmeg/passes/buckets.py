"""Bucket pass: the static order in which parameter gradients become ready in backward,
laid out in contiguous buffers and cut into buckets.

Requires: the pipelined parent graph (pipeline pass).
Ensures: every chunk graph's ``gm.meta["fxmeg_buffers"]`` holds one
``fxmeg.program.BufferLayout`` per gradient dtype, and every trainable parameter's
get_attr node carries ``meta["fxmeg"]["bucket"] = (chunk, dtype, bucket index)``:
  * a parameter's gradient is complete once backward has passed its *first* use in
    forward, so parameters are laid out by first use, latest first (Megatron lays out
    its buffer in reverse parameter order for the same reason);
  * buckets hold whole parameters and close once they reach ``bucket_size`` elements
    (one bucket per buffer when ``bucket_size`` is None);
  * a bucket's end is padded to a multiple of the data-parallel size, and for the
    distributed optimizer (``shard=True``) each parameter starts at a multiple of 64
    elements and each bucket ends at a multiple of lcm(dp, 128), as in Megatron;
  * a parameter read by several chunks of the same pipeline rank (chunk c runs on rank
    c % pp) has one slot, in the lowest such chunk, whose backward runs last.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from fxmeg.passes.graph_utils import attr
from fxmeg.program import Bucket, BufferLayout, Slot, chunks

PARAM_ALIGN = 64  # Megatron: parameter starts in a sharded buffer
BUCKET_ALIGN = 128


def buckets(
    parent: fx.GraphModule,
    *,
    pp: int,
    dp: int,
    bucket_size: int | None,
    shard: bool,
    grad_dtype: torch.dtype | None = torch.float32,
) -> fx.GraphModule:
    """Lay out every chunk's parameter gradients; ``grad_dtype`` None keeps each
    parameter's own dtype (one buffer per dtype)."""
    owner: dict[tuple[int, str], int] = {}  # (pipeline rank, name) -> owning chunk
    for c, gm in enumerate(chunks(parent)):
        for name, p in gm.named_parameters():
            if p.requires_grad:
                owner.setdefault((c % pp, name), c)
    layouts_of: dict[int, tuple[BufferLayout, ...]] = {}
    for c, gm in enumerate(chunks(parent)):
        order = [n for n in _ready_order(gm) if owner[(c % pp, n)] == c]
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in order:
            dtype = grad_dtype or gm.get_parameter(name).dtype
            by_dtype.setdefault(dtype, []).append(name)
        layouts_of[c] = tuple(
            _layout(gm, names, dtype, dp=dp, bucket_size=bucket_size, shard=shard)
            for dtype, names in by_dtype.items()
        )
        gm.meta["fxmeg_buffers"] = layouts_of[c]
    for c, gm in enumerate(chunks(parent)):
        for node in gm.graph.nodes:
            if node.op == "get_attr" and getattr(attr(gm, node.target), "requires_grad", False):
                home = owner[(c % pp, node.target)]
                layout = next(lay for lay in layouts_of[home] if any(s.name == node.target for s in lay.slots))
                node.meta["fxmeg"]["bucket"] = (home, layout.dtype, layout.slot(node.target).bucket)
    return parent


def _ready_order(gm: fx.GraphModule) -> list[str]:
    """Trainable parameters by first use in forward, latest first: backward completes
    their gradients in this order."""
    first_use: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(gm.graph.nodes):
        for j, arg in enumerate(node.all_input_nodes):
            if arg.op == "get_attr" and arg.target not in first_use:
                if getattr(attr(gm, arg.target), "requires_grad", False):
                    first_use[arg.target] = (i, j)
    return sorted(first_use, key=lambda n: first_use[n], reverse=True)


def _layout(gm, names, dtype, *, dp: int, bucket_size: int | None, shard: bool) -> BufferLayout:
    pad_to = math.lcm(dp, BUCKET_ALIGN) if shard else dp
    slots, buckets_, members = [], [], []
    offset = start = 0
    for name in names:
        if shard:
            offset = _round_up(offset, PARAM_ALIGN)
        numel = gm.get_parameter(name).numel()
        slots.append(Slot(name, offset, numel, len(buckets_)))
        members.append(name)
        offset += numel
        if bucket_size is not None and offset - start >= bucket_size:
            end = _round_up(offset, pad_to)
            buckets_.append(Bucket(len(buckets_), start, end, tuple(members)))
            offset = start = end
            members = []
    if members:
        end = _round_up(offset, pad_to)
        buckets_.append(Bucket(len(buckets_), start, end, tuple(members)))
        offset = end
    return BufferLayout(dtype, offset, tuple(slots), tuple(buckets_))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
