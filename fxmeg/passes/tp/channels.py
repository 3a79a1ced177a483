"""Tensor-parallel rules for the layers that mix positions per channel or per head: the
state-space and linear-attention layers of hybrid models (Mamba-2, Gated DeltaNet).

Such a layer projects the hidden state into per-head values (columns split over tp, as
attention's q, k, v), runs a short causal convolution over time on each channel
(``conv1d`` with ``groups`` = channels: depthwise), then a recurrence (a scan, or its
chunked form) that runs per head, and projects back (rows split, all-reduced). Split by
heads, every rank computes its own heads from start to end, exactly; no op mixes heads
but the projections (Megatron-core's Mamba layer splits it the same way).

``ChannelRules`` is mixed into the pass's ``_TensorParallel`` like ``PropagationRules``;
it reads the same state (``g``, ``tp``, ``place``, ``specs``) and helpers (``_spec``,
``refuse``, ``_check_divides``, ``_local_slice``):
  * a depthwise (or grouped) convolution over split channels: its weight's (and bias's)
    output channels split like its input's blocks, ``groups`` divided by tp; a split of
    the positions, or a convolution that contracts channels (groups=1), is refused;
  * ``pad`` keeps the split of a dim it does not pad;
  * ``tril`` / ``triu`` act on the last two dims: the split must lie before them;
  * ``copy_`` (an in-place write into a view, as a chunked scan fills its output) takes
    the destination's split, the source split alike or cut to this rank's part;
  * a replicated operand spanning unequal blocks (Falcon-H1's per-block multipliers on its
    fused projection) is cut block by block, this rank's part of each (``_local_blocks``);
  * a parameter read through casts, views and unary elementwise ops by one op alone (a
    decay ``-exp(A_log)``, a skip ``D[:, None]``) is split with the value it meets
    (``_own_chain``) instead of being held whole.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxmeg.ir.layouts import LOCAL, Shard
from fxmeg.ir.ops import TP
from fxmeg.passes.graph_utils import attr, call, divide_shape_arg, full_args, val
from fxmeg.passes.op_rules import SHAPE_ARGUMENT, in_family, rule
from fxmeg.passes.tp.blocks import CONVOLUTIONS

aten = torch.ops.aten
fxmeg_ops = torch.ops.fxmeg


class ChannelRules:
    @rule(TP, "convolution")
    def _convolution(self, node: fx.Node):
        """A convolution over channels (dim 1) split in blocks: each rank convolves its
        own channels; it needs groups whole on each rank (depthwise: one channel each)."""
        x, w = node.args[0], node.args[1]
        s = self.place.get(x)
        args = full_args(node)
        if node.target == aten.convolution.default and args[6]:
            raise self.refuse(
                node, "a transposed convolution over a split value is not implemented", s
            )
        if not isinstance(s, Shard) or isinstance(self.place.get(w), (Shard, list)):
            raise self.refuse(
                node, "its weight is split over tp ranks (only its input's channels may be)"
            )
        if s.dim != 1:
            raise self.refuse(
                node,
                f"it convolves over dim {s.dim}, which is split over tp ranks (only "
                "the channels, dim 1, may be split)",
                s,
            )
        groups_at = CONVOLUTIONS[node.target]
        groups, c_in, c_out = args[groups_at], val(x).shape[1], val(node).shape[1]
        per_group = c_in // groups
        if any((p // self.tp) % per_group or p % self.tp for p in s.parts):
            raise self.refuse(
                node,
                f"it convolves groups of {per_group} channel(s) ({groups} groups of {c_in}), and "
                f"this rank's part of the channel blocks {s.parts} is not whole groups (groups=1 "
                "sums over every channel: a row-parallel linear's job)",
                s,
            )
        parts = tuple(p * c_out // c_in for p in s.parts)
        self._spec_rows(node, 1, parts)
        bias = args[2]
        if isinstance(bias, fx.Node):
            self._spec_rows(node, 2, parts)
        node.args = tuple(args[:groups_at]) + (groups // self.tp,) + tuple(args[groups_at + 1:])
        node.kwargs = {}
        return Shard(1, parts, origin=s.origin)

    def _spec_rows(self, node: fx.Node, index: int, parts: tuple[int, ...]) -> None:
        """Split dim 0 of operand ``index`` of ``node`` (a convolution's weight or bias)
        in ``parts``: the parameter itself when it reaches ``node`` alone through views
        and casts that keep dim 0 (``conv1d.weight.squeeze(1).unsqueeze(1)``), else this
        rank's rows of the value."""
        w = node.args[index]
        chain = _chain_to_parameter(self.gm, w, 0)
        if chain is None:
            split = Shard(0, parts)
            node.replace_input_with(w, self._local_slice(node, w, 0, split))
            return
        param, _, steps = chain
        self._spec(param, 0, parts, node)
        for step, _ in steps:
            if step.target in SHAPE_ARGUMENT:
                divide_shape_arg(step, 0, self.tp)
            self.place[step] = Shard(0, parts)

    @rule(TP, "pad")
    def _pad(self, node: fx.Node):
        """``pad`` (constant): a dim it leaves alone keeps its split."""
        s = self.place[node.args[0]]
        widths, n = list(node.args[1]), val(node).dim()
        padded = {n - 1 - i // 2 for i, w in enumerate(widths) if w}
        if s.dim in padded:
            raise self.refuse(node, f"it pads dim {s.dim}, which is split over tp ranks", s)
        if len(node.args) > 2 and node.args[2] not in ("constant",):
            raise self.refuse(
                node, f"it pads with mode {node.args[2]!r} (only 'constant' is split)", s
            )
        return s

    @rule(TP, "triangle")
    def _triangle(self, node: fx.Node):
        """``tril`` / ``triu`` keep (or zero) entries of the last two dims: the split must
        lie before them."""
        s = self.place[node.args[0]]
        if s.dim >= val(node).dim() - 2:
            raise self.refuse(node, f"it takes a triangle of the last two dims, and dim {s.dim} is "
                                          "split over tp ranks", s)
        return s

    @rule(TP, "write")
    def _write(self, node: fx.Node):
        """``copy_(dst, src)``: the destination keeps its split; the source must be split
        alike, or is cut to this rank's part (a replicated value broadcast into it); a
        sequence-parallel source written into a value split otherwise (over heads) is
        gathered whole first, as a column-parallel linear's input is."""
        dst, src = node.args[0], node.args[1]
        d, s = self.place.get(dst), self.place.get(src)
        if isinstance(s, Shard) and s.seq and isinstance(d, Shard) and not d.seq:
            # MLA's rotary key, shared by every head, into the head-split key states
            src, s = self._entry(node, src), None  # the whole sequence (sp_gather)
            node.args = (dst, src, *node.args[2:])
        if not isinstance(d, Shard):
            raise self.refuse(node, "it writes a value split over tp ranks into one that is not "
                                          "(each rank would write only its part)", s)
        if isinstance(s, Shard):
            if s.moved(s.dim + val(dst).dim() - val(src).dim()) != d:
                raise self.refuse(
                    node, "it writes a value split differently from its destination", s
                )
            return d
        j = d.dim - (val(dst).dim() - val(src).dim())
        if isinstance(src, fx.Node) and j >= 0 and val(src).shape[j] != 1:
            node.replace_input_with(src, self._local_slice(node, src, j, d))
        return d

    @rule(TP, "new")
    def _new(self, node: fx.Node):
        """``x.new_empty(sizes)`` and kin: a fresh tensor, filled later (MLA's key states,
        written a slice at a time). Sized like ``x`` along its split dim, it is split there
        too (its size there divided by tp); otherwise it is replicated."""
        s = self.place[node.args[0]]
        sizes = list(node.args[1])
        x = val(node.args[0])
        if len(sizes) != x.dim() or sizes[s.dim] != x.shape[s.dim]:
            return None
        sizes[s.dim] //= self.tp
        node.args = (node.args[0], sizes, *node.args[2:])
        return s

    def _local_blocks(self, node: fx.Node, a: fx.Node, dim: int, split: Shard) -> fx.Node:
        """This rank's part of every block of replicated ``a`` along ``dim`` (blocks of
        unequal sizes), laid end to end as the split value holds them."""
        for p in split.parts:
            self._check_divides(node, p, f"block of dim {dim} of operand {a.name!r}")
        with self.g.inserting_before(node):
            blocks = call(
                self.g, aten.split_with_sizes.default, (a, list(split.parts), dim), like=node
            )
            self.place[blocks] = None
            mine = []
            for i in range(len(split.parts)):
                block = call(self.g, operator.getitem, (blocks, i), like=node)
                mine.append(self.move(block, "replicated", "local", dim=dim, at=node))
                self.place[block], self.place[mine[-1]] = None, LOCAL
            out = call(self.g, aten.cat.default, (mine, dim), like=node)
        self.place[out] = LOCAL
        return out

    def _own_chain(self, a: fx.Node, dim: int, split: Shard, node: fx.Node) -> bool:
        """Split the trainable parameter that ``a`` is computed from alone (through casts,
        views and unary elementwise ops, each read once) along the dim that becomes dim
        ``dim`` of ``a``, like ``split``; False when ``a`` is no such value."""
        chain = _chain_to_parameter(self.gm, a, dim, unary=True)
        if chain is None or not getattr(attr(self.gm, chain[0].target), "requires_grad", False):
            return False
        param, param_dim, steps = chain
        if any(step.target in SHAPE_ARGUMENT for step, _ in steps):
            return False  # a view with sizes: left to _local_slice
        self._spec(param, param_dim, split.parts, node)
        for step, d in steps:
            self.place[step] = split.moved(d)
        return True


def _chain_to_parameter(gm: fx.GraphModule, a: fx.Node, dim: int, *, unary: bool = False):
    """(parameter get_attr, its dim that becomes dim ``dim`` of ``a``, [(step, the dim of
    the step's output on that path)...]) when ``a`` is computed from one parameter alone
    by casts and views (and, with ``unary``, unary elementwise ops) that keep that dim
    whole, each read once; else None."""
    steps, n, d = [], a, dim
    while n.op == "call_function":
        if len(n.all_input_nodes) != 1 or len(n.users) != 1:
            return None
        src = n.args[0]
        if not isinstance(src, fx.Node) or (d_in := _source_dim(n, src, d, unary)) is None:
            return None
        steps.append((n, d))
        n, d = src, d_in
    if n.op != "get_attr" or len(n.users) != 1 or not isinstance(val(n), torch.Tensor):
        return None
    readers = [m for m in n.graph.nodes if m.op == "get_attr" and m.target == n.target]
    return (n, d, steps) if readers == [n] else None


def _source_dim(step: fx.Node, src: fx.Node, d: int, unary: bool) -> int | None:
    """The dim of ``src`` that ``step`` (a cast, view or unary op) carries to dim ``d``."""
    out, into = val(step), val(src)
    if out is None or into is None:
        return None
    if in_family(step.target, "copy") or (unary and in_family(step.target, "pointwise")):
        return d if out.shape == into.shape else None
    if step.target == aten.slice.Tensor:  # all of a dim (x[None, :, None, :])
        return d if out.shape == into.shape else None
    if step.target == aten.unsqueeze.default:
        k = step.args[1] % out.dim()
        return None if d == k else d - (d > k)
    if step.target == aten.squeeze.dim:
        k = step.args[1] % into.dim()
        return d + (d >= k) if into.shape[k] == 1 else (d if into.dim() == out.dim() else None)
    if step.target in SHAPE_ARGUMENT and into.shape[0] == out.shape[0] and d == 0:
        return 0
    return None
