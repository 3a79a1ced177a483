"""More propagation rules of the tensor-parallel pass, kept apart from tp_rules.py so each
file reads on its own: ops that unpack or index a split value (``unbind``,
``aten.index.Tensor``), a batched product added to a third operand (``baddbmm``), and
the ops that compute over the split dim itself and stay exact with a collective: a
softmax or log-softmax (a max and a sum all-reduced over tp ranks) and a max or min
(``amax`` / ``amin``: a max all-reduced, ``fxmeg::tp_max``). Also two questions the
pass's linears ask of the graph: whether a linear's output rejoins its own input (the
residual stream: it stays whole) and whether a view cuts a fused projection into
(q / k / v blocks, heads, head_dim) (``fused_view``).

``MoreRules`` is mixed into the pass's ``_TensorParallel`` like ``PropagationRules``; it
reads the same state (``g``, ``tp``, ``place``) and helpers (``refuse``,
``_local_slice``, ``_matmul``, ``_all_sum``, ``statistics``).
"""

from __future__ import annotations

import torch
from torch import fx

from fxmeg.ir.layouts import LOCAL, Shard
from fxmeg.ir.ops import TP
from fxmeg.passes.graph_utils import call, expand_add_matmul, users_reached, val
from fxmeg.passes.op_rules import LINEAR_SLOTS, dim_argument, in_family, rule
from fxmeg.passes.tp.placement import dim_groups

aten = torch.ops.aten
fxmeg_ops = torch.ops.fxmeg
EXTREMES = {
    aten.amax.default: False,
    aten.amin.default: True,
    aten.max.default: False,
    aten.min.default: True,
}
"""Reductions to a maximum (False) or minimum (True) over the split dim: all-reduced."""
_LOG_SOFTMAX = {aten._log_softmax.default, aten.log_softmax.int}


class MoreRules:
    def _rejoins_its_input(self, node: fx.Node) -> bool:
        """Whether the linear's output meets, before any linear reads it, a value of its
        own shape that its input is computed from: the residual stream (an output
        projection whose input is replicated because its block's other projections are
        kept whole by ``plan``, a gate multiplying the hidden state). Split by columns it
        would split the stream it is added to, so it stays whole."""
        x = node.args[LINEAR_SLOTS[node.target].x]
        if x not in self.ancestors:
            todo, seen = [x], {x}
            while todo:
                for a in todo.pop().all_input_nodes:
                    if a not in seen:
                        seen.add(a)
                        todo.append(a)
            self.ancestors[x] = seen
        before = self.ancestors[x]
        # past every op but a linear (a row-parallel linear reads it: the stream stays whole)
        for user in users_reached(node, through=lambda u: u.target not in LINEAR_SLOTS):
            if in_family(user.target, "pointwise") and any(
                    a in before and val(a) is not None and val(a).shape == val(user).shape
                    for a in user.all_input_nodes):
                return True
        return False

    @rule(TP, "unbind")
    def _unbind(self, node: fx.Node):
        """Every entry along another dim than the split one (a rotary embedding's real and
        imaginary halves, q / k / v of a fused projection viewed as (3, heads, head_dim)):
        each keeps the split, moved past the removed dim."""
        s = self.place[node.args[0]]
        dim = dim_argument(node, 0) % val(node.args[0]).dim()
        if dim == s.dim:
            raise self.refuse(node, f"it unbinds the split dim {dim}", s)
        return [s.moved(s.dim - (dim < s.dim))] * len(node.meta["val"])

    @rule(TP, "complex")
    def _complex_view(self, node: fx.Node):
        """``view_as_complex`` reads the last dim's (real, imaginary) pairs as one complex
        value, ``view_as_real`` spells each out again as a trailing pair (Llama 4's rotary
        embedding of the head-split q and k): every other dim, the split one (heads) among
        them, stays where it is. The pair dim itself must not be split: a rank would hold
        half of a number."""
        s = self.place[node.args[0]]
        if node.target == aten.view_as_complex.default and s.dim == val(node.args[0]).dim() - 1:
            raise self.refuse(node, f"it reads the split dim {s.dim} as (real, imaginary) pairs", s)
        return s

    @rule(TP, "advanced_index")
    def _advanced_index(self, node: fx.Node):
        """``x[..., idx, ...]`` with replicated index tensors on other dims than the split
        one: the split dim moves as numpy's advanced indexing moves it (index dims
        side by side replace themselves in place, else they go first)."""
        s = self.place.get(node.args[0])
        indices, n = list(node.args[1]), val(node.args[0]).dim()
        if not isinstance(s, Shard) or any(
            isinstance(self.place.get(i), (Shard, list)) for i in indices if isinstance(i, fx.Node)
        ):
            raise self.refuse(
                node, "it indexes with a split index", s if isinstance(s, Shard) else None
            )
        indexed = [d for d, i in enumerate(indices) if i is not None]
        if s.dim in indexed:
            raise self.refuse(node, f"it indexes the split dim {s.dim}", s)
        extra = val(node).dim() - (n - len(indexed))  # the broadcast index's dims
        if indexed != list(range(indexed[0], indexed[-1] + 1)):  # apart: index dims first
            return s.moved(extra + s.dim - sum(d < s.dim for d in indexed))
        return s.moved(s.dim if s.dim < indexed[0] else s.dim + extra - len(indexed))

    @rule(TP, "add_matmul")
    def _add_matmul(self, node: fx.Node):
        """``baddbmm`` as ``beta * input + alpha * (a @ b)`` (``expand_add_matmul``): the
        product by the matmul rule, the sum by the pointwise rule (``input`` split alike,
        or cut to this rank's part)."""
        for n in (new := expand_add_matmul(node)):
            self.place[n] = self.visit(n)
        return self.place[new[-1]]

    def _softmax_over_split(self, node: fx.Node, s: Shard):
        """Softmax (or log-softmax) along the split dim: the maximum (no gradient: a
        softmax does not see a shift) and the sum of exponentials all-reduced over tp
        ranks, each rank normalising its own part; ``_safe_softmax`` (SDPA's math path)
        gives 0 where the whole row is -inf, as it does on one device."""
        x, d = node.args[0], dim_argument(node) % val(node.args[0]).dim()

        def add(target, *args, place=s, **kwargs):
            with self.g.inserting_before(node):
                new = call(self.g, target, args, kwargs, like=node)
            self.place[new] = place
            return new

        if val(x).dtype != val(node).dtype:
            x = add(aten._to_copy.default, x, dtype=val(node).dtype)
        top = add(aten.amax.default, add(aten.detach.default, x), [d], True, place=LOCAL)
        top = self.move(top, "partial_max", "replicated", at=node)
        self.place[top] = None
        shifted = add(aten.sub.Tensor, x, top)
        masked = None
        # rows -inf on every rank: 0, and no NaN in backward
        if node.target == aten._safe_softmax.default:
            masked = add(aten.eq.Scalar, top, float("-inf"), place=None)
            shifted = add(aten.where.ScalarSelf, masked, 0.0, shifted)
        exp = add(aten.exp.default, shifted)
        total = self._all_sum(add(aten.sum.dim_IntList, exp, [d], True, place=LOCAL), node)
        if node.target in _LOG_SOFTMAX:
            out = add(aten.sub.Tensor, shifted, add(aten.log.default, total, place=None))
        else:
            out = add(aten.div.Tensor, exp, total)
        if masked is not None:
            out = add(aten.where.ScalarSelf, masked, 0.0, out)
        node.replace_all_uses_with(out)
        self.g.erase_node(node)
        return s

    def _extreme_over_split(self, node: fx.Node, s: Shard):
        """A maximum (minimum) over the split dim: the local one, all-reduced with
        ``fxmeg::tp_max`` (of the negation for a minimum); its gradient goes to the rank
        holding it, summed over ranks first when split values read it (a ``tp_copy`` after it)."""
        users = list(node.users)
        out = node
        if EXTREMES[node.target]:
            with self.g.inserting_after(node):
                out = call(self.g, aten.neg.default, (node,), like=node)
        top = self.move(out, "partial_max", "replicated", at=out, after=True, like=node)
        copy = self.move(top, "replicated", "synced", at=top, after=True, like=node)
        result = copy
        if EXTREMES[node.target]:
            with self.g.inserting_after(copy):
                result = call(self.g, aten.neg.default, (copy,), like=node)
        self.place.update({out: LOCAL, top: None, copy: None, result: None})
        self.statistics.append((copy, node))
        for user in users:
            user.replace_input_with(node, result)
        return LOCAL


def fused_view(view: fx.Node, out: int) -> int | None:
    """The number of fused blocks when ``view`` cuts the last dim (``out`` features) into
    (blocks, heads, head_dim...) and the blocks dim is then unpacked (unbind, select or
    split, after permutes): q, k and v of a fused projection, as llama2.c's or einops'
    ``rearrange(qkv, 'b n (three h d) -> three b h n d')`` write it. Bloom's per-head
    (heads, 3, head_dim) unpacks an inner dim instead: its heads stay the outer dim."""
    shape, size, first = tuple(val(view).shape), 1, len(val(view).shape)
    while first > 0 and size < out:
        first -= 1
        size *= shape[first]
    sizes = [d for d in range(first, len(shape)) if shape[d] != 1]
    if size != out or len(sizes) < 3:
        return None
    todo = [(view, sizes[0])]
    while todo:
        n, dim = todo.pop()
        for user in n.users:
            if user.target in (aten.unbind.int, aten.select.int) or in_family(user.target, "split"):
                if dim_argument(user, 0) % val(n).dim() == dim:
                    return shape[sizes[0]]
            elif user.target == aten.permute.default:
                todo.append((user, [d % val(n).dim() for d in user.args[1]].index(dim)))
            elif user.target == aten.transpose.int:
                i, j = (d % val(n).dim() for d in user.args[1:3])
                todo.append((user, {i: j, j: i}.get(dim, dim)))
            elif in_family(user.target, "copy"):
                todo.append((user, dim))
            elif in_family(user.target, "view") and user.target != aten.expand.default:
                kept = [gj for gi, gj in dim_groups(tuple(val(n).shape), tuple(val(user).shape))
                        # the blocks dim kept whole
                        if [d for d in gi if val(n).shape[d] != 1] == [dim]]
                outs = [d for d in (kept[0] if kept else []) if val(user).shape[d] != 1]
                if len(outs) == 1:
                    todo.append((user, outs[0]))
    return None
