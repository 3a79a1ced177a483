"""Bucket pass: the static order in which parameter gradients become ready in backward,
laid out in contiguous buffers and cut into buckets.

Scope: the pipelined parent graph, every chunk at once (not one chunk at a time): a
parameter read by several chunks of one pipeline rank gets one slot on that rank, so the
layout of a chunk depends on the other chunks placed on its rank.
Requires: the pipelined parent graph (pipeline pass) with the partition's placement.
Ensures: every chunk graph's ``gm.meta["fxmeg"]["buffers"]`` holds one
``fxmeg.ir.program.BufferLayout`` per gradient dtype (fp32: gradients accumulate in fp32
whatever the parameters' precision), and a second one (``experts=True``) for the banks of
routed experts under expert parallelism (reduced and sharded over the expert-data-parallel
ranks, so padded to their count: each bank's bucket indices count from 0 in its own
buffer), and every trainable parameter's
get_attr node carries ``meta["fxmeg"]["bucket"]``, a ``fxmeg.ir.layouts.BucketSlot(chunk, dtype,
index, experts)``:
  * a parameter's gradient is complete once backward has passed its *first* use in
    forward, so parameters are laid out by first use, latest first (Megatron lays out
    its buffer in reverse parameter order for the same reason);
  * buckets hold whole parameters and close once they reach ``bucket_size`` elements
    (one bucket per buffer when ``bucket_size`` is None); at ``zero >= 2`` they also close
    wherever the next parameter is first read in another transformer block (the blocks of
    ``partition.find_blocks``; what comes before the first block or after the last counts
    as a block of its own), so that a bucket is what zero=3 gathers and frees as a unit;
  * a bucket's end is padded to a multiple of the data-parallel size, and for the
    distributed optimizer (``shard=True``) each parameter starts at a multiple of 64
    elements and each bucket ends at a multiple of lcm(dp, 128), as in Megatron;
  * a parameter read by several chunks of the same pipeline rank has one slot, in the
    lowest such chunk, whose backward runs last;
  * slot sizes are the parameters' local (tensor-parallel shard) sizes, read from the
    get_attr nodes' ``meta["val"]``;
"""

from __future__ import annotations

import math

import torch
from torch import fx

from fxmeg.config import ParallelConfig
from fxmeg.config_sections import DataParallelConfig
from fxmeg.ir.layouts import BucketSlot
from fxmeg.ir.program import Bucket, BufferLayout, Slot, chunks
from fxmeg.ir.tags import has_tag, set_tag, tag
from fxmeg.passes.graph_utils import attr, val
from fxmeg.passes.partition import find_blocks
from fxmeg.sharding_modes import OptimizerSharding

PARAM_ALIGN = 64  # Megatron: parameter starts in a sharded buffer
GRAD_DTYPE = torch.float32
BUCKET_ALIGN = 128


def buckets(parent: fx.GraphModule, *, parallel: ParallelConfig,
            data_parallel: DataParallelConfig) -> fx.GraphModule:
    """Lay out the parameter gradients of every chunk of the pipelined ``parent`` graph
    (``parallel``: dp x cp and edp; ``data_parallel``: bucket size, ZeRO stage, whether the
    distributed optimizer shards the buffers)."""
    placement = tag(parent, "partition").placement
    dp, size = (
        parallel.dp_cp,
        data_parallel.resolved_bucket_size(parallel.dp),
    )  # gradients shard over dp x cp
    shard = data_parallel.sharding is OptimizerSharding.ELEMENTWISE  # flat shards
    owner: dict[tuple[int, str], int] = {}  # (pipeline rank, name) -> owning chunk
    for c, gm in enumerate(chunks(parent)):
        for name, p in gm.named_parameters():
            if p.requires_grad:
                owner.setdefault((placement[c], name), c)
    layouts_of: dict[int, tuple[BufferLayout, ...]] = {}
    for c, gm in enumerate(chunks(parent)):
        names = [n for n in _ready_order(gm) if owner[(placement[c], n)] == c]
        block = _blocks(gm) if data_parallel.zero_stage >= 2 else {}
        shapes = {n.target: val(n).shape for n in gm.graph.nodes
                  if n.op == "get_attr" and val(n) is not None}  # not a region's body
        experts = {n.target for n in gm.graph.nodes if n.op == "get_attr" and has_tag(n, "ep")}
        dense = [n for n in names if n not in experts]
        routed = [n for n in names if n in experts]
        layouts_of[c] = tuple(
            _layout(
                group,
                shapes,
                GRAD_DTYPE,
                dp=ranks,
                bucket_size=size,
                shard=shard,
                experts=is_expert,
                block=block,
            )
            for group, ranks, is_expert in ((dense, dp, False), (routed, parallel.edp, True))
            if group
        )
        set_tag(gm, "buffers", layouts_of[c])
    for c, gm in enumerate(chunks(parent)):
        for node in gm.graph.nodes:
            if node.op == "get_attr" and getattr(attr(gm, node.target), "requires_grad", False):
                home = owner[(placement[c], node.target)]
                layout = next(
                    lay for lay in layouts_of[home] if any(s.name == node.target for s in lay.slots)
                )
                slot = BucketSlot(
                    home, layout.dtype, layout.slot(node.target).bucket, experts=layout.experts
                )
                set_tag(node, "bucket", slot)
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


def _blocks(gm: fx.GraphModule) -> dict[str, str]:
    """Trainable parameter -> the block of its first reader ('' outside every block). A
    recompute region's reader is in the block its own nodes run in (under full recompute
    every block is one region: without this, ZeRO-2/3 put the whole chunk in one bucket)."""
    of_node, out = find_blocks(gm), {}
    for node in gm.graph.nodes:
        block = of_node.get(node) or _region_block(gm, node)
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg.target not in out:
                out[arg.target] = block
    return out


def _region_block(gm: fx.GraphModule, node: fx.Node) -> str:
    """The one block a recompute region's nodes run in ('' for any other node)."""
    region = getattr(gm.get_submodule(node.target), "region", None) if (
        node.op == "call_module") else None
    if not isinstance(region, fx.GraphModule):
        return ""
    found = set(find_blocks(region).values())
    return found.pop() if len(found) == 1 else ""


def _layout(names, shapes, dtype, *, dp: int, bucket_size: int | None, shard: bool,
            experts: bool = False, block: dict[str, str] | None = None) -> BufferLayout:
    pad_to = math.lcm(dp, BUCKET_ALIGN) if shard else dp
    slots, buckets_, members = [], [], []
    offset = start = 0
    block = block or {}
    for i, name in enumerate(names):
        if shard:
            offset = _round_up(offset, PARAM_ALIGN)
        numel = shapes[name].numel()
        slots.append(Slot(name, offset, numel, len(buckets_)))
        members.append(name)
        offset += numel
        full = bucket_size is not None and offset - start >= bucket_size
        if full or (block and i + 1 < len(names) and block.get(names[i + 1]) != block.get(name)):
            end = _round_up(offset, pad_to)
            buckets_.append(Bucket(len(buckets_), start, end, tuple(members)))
            offset = start = end
            members = []
    if members:
        end = _round_up(offset, pad_to)
        buckets_.append(Bucket(len(buckets_), start, end, tuple(members)))
        offset = end
    return BufferLayout(dtype, offset, tuple(slots), tuple(buckets_), experts)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
