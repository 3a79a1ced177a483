"""The one step that moves a value between placements on an axis: every collective and
local cut a sharding rule needs is an entry of ``MOVES`` (as DTensor's ``redistribute``
is one function over its placements).

A placement is named here by its kind: ``replicated`` (every rank holds all of it),
``synced`` (replicated, read by split values: each rank's gradient is a part, summed in
backward: Megatron's f), ``whole`` (replicated, every rank computing the same values from
it and holding their whole gradient: a routed-experts block under sp, which gathers the
sequence and cuts it again, each rank's gradient its own part of the whole one's),
``local`` (this rank's part of a replicated value), ``seq`` (split
along the sequence: sp's residual stream, cp's every value), ``partial`` (each rank holds
a part of a sum; ``partial_max`` of a maximum). The ops are ``fxmeg::`` ops on the axis's symbolic
group, bound at run time (fxmeg/ir/ops.py says what each does forward and backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from fxmeg.ir import ops as _registers_fxmeg_ops  # noqa: F401  (torch.ops.fxmeg.* below)
from fxmeg.passes.graph_utils import call

fx_ops = torch.ops.fxmeg


@dataclass(frozen=True)
class Move:
    """The op that takes a value from one placement to another, and whether it reads
    the dim and the axis's size (``op(x, dim, size, group)``) or only the group."""

    op: object
    along_dim: bool


MOVES: dict[tuple[str, str, str], Move] = {
    # (axis, from, to)
    ("tp", "replicated", "local"): Move(fx_ops.tp_slice.default, True),
    ("tp", "replicated", "synced"): Move(fx_ops.tp_copy.default, False),
    ("tp", "local", "synced"): Move(fx_ops.tp_copy.default, False),
    ("tp", "partial", "synced"): Move(fx_ops.tp_copy.default, False),
    ("tp", "partial_max", "replicated"): Move(fx_ops.tp_max.default, False),
    ("tp", "partial", "replicated"): Move(fx_ops.tp_reduce.default, False),
    ("tp", "partial", "seq"): Move(fx_ops.sp_scatter.default, True),
    ("tp", "seq", "replicated"): Move(fx_ops.sp_gather.default, True),
    # every rank then computes the same whole values and holds their whole gradient
    ("tp", "seq", "whole"): Move(fx_ops.sp_whole.default, True),
    ("tp", "whole", "seq"): Move(fx_ops.sp_split.default, True),
    ("cp", "replicated", "seq"): Move(fx_ops.cp_slice.default, True),
    ("cp", "seq", "replicated"): Move(fx_ops.cp_gather.default, True),
    ("cp", "partial", "replicated"): Move(fx_ops.cp_all_reduce.default, False),
}


def insert_move(g: fx.Graph, axis: str, value: fx.Node, src: str, dst: str, *, size: int,
                 dim: int | None = None, at: fx.Node, after: bool = False,
                 like: fx.Node | None = None) -> fx.Node:
    """A node computing ``value`` moved from placement ``src`` to ``dst`` on ``axis``
    (``size`` ranks; ``dim`` for the moves along a dim), inserted before ``at`` (after it
    with ``after``), its metadata like ``like`` (default ``at``). An unknown move is a bug
    of the calling rule, not a user's error."""
    move = MOVES.get((axis, src, dst))
    assert move is not None, f"no move of a {src} value to {dst} on axis {axis!r}"
    assert (dim is not None) == move.along_dim, f"{move.op}: dim {dim!r}"
    args = (value, dim, size, axis) if move.along_dim else (value, axis)
    with (g.inserting_after(at) if after else g.inserting_before(at)):
        return call(g, move.op, args, like=like if like is not None else at)
