"""How a tensor-parallel split travels through each kind of op: the propagation rules of
the tensor-parallel pass (fxmeg/passes/tensor_parallel.py), kept apart from its driver,
linears, vocabulary and parameter handling so each file reads on its own.

``PropagationRules`` is mixed into the pass's ``_TensorParallel``: it reads the pass's
state (``g`` the graph, ``tp``, ``place``: node -> Shard | PARTIAL | LOCAL | None,
``statistics``) and calls its helpers (``_spec``, ``refuse``, ``_check_divides``).
Each rule is registered for its op families (``@rule(TP, family, ...)``, the one registry
in ``passes/op_rules.py``), takes a node whose inputs have places and returns the node's
place, rewriting the node's shape arguments to local sizes where needed, or raises a
PassError naming the node and a fix (docs/errors.md, row tp-unsplittable).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import fx

from fxmeg.errors import PassError
from fxmeg.frontend.capture import owning_module
from fxmeg.ir.layouts import LOCAL, PARTIAL, Shard
from fxmeg.ir.ops import TP
from fxmeg.passes.graph_utils import call, carries_grad, divide_shape_arg, full_args, val
from fxmeg.passes.op_rules import SHAPE_ARGUMENT, dim_argument, in_family, rule
from fxmeg.passes.redistribute import insert_move
from fxmeg.passes.tp.moe import flattens_tokens, from_whole, whole_tokens
from fxmeg.passes.tp.placement import (
    Indivisible,
    divisors,
    einsum_letters,
    matmul_letters,
    reshape_shard,
)
from fxmeg.passes.tp.rules_more import EXTREMES
from fxmeg.torch_private import op_schema

aten = torch.ops.aten
fxmeg_ops = torch.ops.fxmeg
# collectives whose backward reduces the gradient over tp ranks: a parameter reaching a split
# value only through one of them gets the same gradient on every rank (tp_slice does not)
_SYNCED = {fxmeg_ops.tp_copy.default, fxmeg_ops.tp_reduce.default, fxmeg_ops.sp_gather.default,
           fxmeg_ops.sp_scatter.default, fxmeg_ops.vocab_parallel_cross_entropy.default,
           fxmeg_ops.sp_whole.default, fxmeg_ops.sp_split.default}


def _indivisible(node: fx.Node, why: Indivisible, s: Shard, tp: int) -> str:
    """tp does not divide the outer size a reshape splits the features into: the heads
    (choose another tp), or, when the features go into three sizes or more (three, heads,
    head_dim), fused blocks a single rearrange splits out together with the heads."""
    where = f"node {node.name!r} ({node.target.__name__}, module {owning_module(node)!r})"
    msg = (f"tp={tp} does not divide {why.size}, the number of heads (or groups) that {where} "
           f"splits the features into {why.sizes}")
    block = s.origin.rpartition(".")[0]
    if len(why.sizes) < 3:
        glob = re.sub(r"\.\d+\.", ".*.", s.origin)
        return (
            f"{msg}; choose tp in {divisors(why.size)}, or keep the projection that splits them "
            f"whole with tp_plan={{{glob!r}: 'replicate'}}"
        )
    return (
        f"{msg}. If the {why.size} are fused blocks (q, k, v as in rearrange('b n (three h d) -> "
        f"three b n (h d)')), split them before the heads: write the projection's output as "
        f".chunk({why.size}, dim=-1) (or separate linears), then rearrange each; or keep the "
        f"block whole with tp_plan={{{(block + '.*') if block else s.origin!r}: 'replicate'}}"
    )


class PropagationRules:
    @rule(TP, "copy", "random")
    def _same(self, node: fx.Node):
        """Casts, copies and random draws shaped like their input keep its split (a
        random op on a split value draws from this rank's stream: ``_per_rank_streams``)."""
        return self.place[node.args[0]]

    @rule(TP, "pointwise")
    def _elementwise(self, node: fx.Node):
        out_dim = val(node).dim()
        shards = [
            (a, self.place[a]) for a in node.all_input_nodes if isinstance(self.place.get(a), Shard)
        ]
        s0 = shards[0][1].moved(shards[0][1].dim + out_dim - val(shards[0][0]).dim())
        for a, s in shards[1:]:
            if s.moved(s.dim + out_dim - val(a).dim()) != s0:
                raise self.refuse(node, "its operands are split differently", s)
        for a in node.all_input_nodes:
            if isinstance(self.place.get(a), Shard) or val(a) is None:
                continue
            j = s0.dim - (out_dim - val(a).dim())
            if j >= 0 and val(a).shape[j] != 1:  # a replicated operand spans the split dim
                # a norm's weight over split features: shard it too
                if self._own_chain(a, j, s0, node):
                    continue
                if s0.seq and from_whole(self, a):  # a routed-experts block's output (tp_moe)
                    piece = self.move(a, "whole", "seq", dim=j, at=node)
                    self.place[piece] = s0.moved(j)
                    node.replace_input_with(a, piece)
                    continue
                node.replace_input_with(a, self._local_slice(node, a, j, s0))
        return s0

    def _local_slice(self, node: fx.Node, a: fx.Node, dim: int, split: Shard | None = None):
        """This rank's part of replicated operand ``a`` along ``dim``, where the value it
        meets is ``split``: of each block when it has several equal ones (heads merged into
        the batch), cut as (blocks, block) so one tp_slice takes every block's part."""
        size = val(a).shape[dim]
        parts = (
            split.parts if split is not None and val(a).shape[dim] == sum(split.parts) else (size,)
        )
        if len(set(parts)) > 1:  # unequal blocks (tp_channels)
            return self._local_blocks(node, a, dim, split)
        self._check_divides(node, parts[0], f"dim {dim} of operand {a.name!r}")
        shape = list(val(a).shape)
        if len(parts) > 1:
            with self.g.inserting_before(node):
                a = call(
                    self.g,
                    aten.reshape.default,
                    (a, shape[:dim] + [len(parts), parts[0]] + shape[dim + 1 :]),
                    like=node,
                )
            self.place[a] = None
        piece = self.move(a, "replicated", "local", dim=dim + (len(parts) > 1), at=node)
        if len(parts) > 1:
            self.place[piece] = LOCAL
            shape[dim] //= self.tp
            with self.g.inserting_before(node):
                piece = call(self.g, aten.reshape.default, (piece, shape), like=node)
        self.place[piece] = LOCAL  # this rank's part of a replicated value
        return piece

    @rule(TP, "view")
    def _reshape(self, node: fx.Node):
        s = self.place[node.args[0]]
        a, b = tuple(val(node.args[0]).shape), tuple(val(node).shape)
        if node.target == aten.expand.default:
            lead = len(b) - len(a)
            sizes = list(node.args[1])
            if sizes[s.dim + lead] not in (-1,):
                sizes[s.dim + lead] //= self.tp
            node.args = (node.args[0], sizes, *node.args[2:])
            return s.moved(s.dim + lead)
        moved = reshape_shard(s, a, b, self.tp)
        if isinstance(moved, str) and flattens_tokens(s, a, b):  # routing each token (tp_moe)
            whole_tokens(self, node, s)
            return None
        if isinstance(moved, Indivisible):  # the usual case: heads or KV heads
            raise PassError(_indivisible(node, moved, s, self.tp))
        if isinstance(moved, str):
            raise self.refuse(node, moved, s)
        if node.target in SHAPE_ARGUMENT:
            divide_shape_arg(node, moved.dim, self.tp)
        return moved

    @rule(TP, "permute")
    def _permute(self, node: fx.Node):
        s, n = self.place[node.args[0]], val(node).dim()
        if node.target == aten.transpose.int:
            i, j = node.args[1] % n, node.args[2] % n
            return s.moved({i: j, j: i}.get(s.dim, s.dim))
        if node.target == aten.t.default:
            return s.moved(1 - s.dim)
        return s.moved([d % n for d in node.args[1]].index(s.dim))

    @rule(TP, "split")
    def _split(self, node: fx.Node):
        s = self.place[node.args[0]]
        dim = dim_argument(node) % val(node.args[0]).dim()
        pieces = node.meta["val"]  # a list of fake tensors
        if dim != s.dim:
            return [s] * len(pieces)
        sizes = [v.shape[dim] for v in pieces]
        runs = _runs(s.parts, sizes)
        if runs is None:
            raise self.refuse(
                node, f"it splits the dim into {sizes}, not into runs of its blocks {s.parts}", s
            )
        if node.target == aten.split.Tensor:
            node.args = (node.args[0], node.args[1] // self.tp, *node.args[2:])
        elif node.target == aten.split_with_sizes.default:
            node.args = (node.args[0], [x // self.tp for x in node.args[1]], *node.args[2:])
        return [s.moved(dim, run) for run in runs]

    @rule(TP, "slice")
    def _slice(self, node: fx.Node):
        """A slice along another dim keeps the split; along the split dim, a slice of whole
        blocks (a fused projection's q, k, v: ``qkv[..., :q_size]``) takes this rank's
        part of each of them (its bounds divided by tp), a slice of every step-th entry
        (``x[..., 1::2]``) this rank's every step-th where each rank's part of each block is
        a multiple of step; a slice of everything keeps it."""
        s = self.place[node.args[0]]
        x, dim, start, end, step = full_args(node)[:5]
        dim = dim % val(node).dim()
        size = val(node.args[0]).shape[dim]
        start, end = _bounds(start, end, size)
        if dim != s.dim or (start, end, step) == (0, size, 1):
            return s
        if step > 1 and start < step and end == size and all(p // self.tp % step == 0
                                                             for p in s.parts):
            # every step-th feature (GPT-OSS's experts interleave gate and up): each rank's
            # part of every block starts at a multiple of step, so its own every step-th
            node.args, node.kwargs = (x, dim, start, size // self.tp, step), {}
            return s.moved(dim, tuple(p // step for p in s.parts))
        edges = [sum(s.parts[:i]) for i in range(len(s.parts) + 1)]
        if step != 1 or start not in edges or end not in edges:
            raise self.refuse(
                node,
                f"it slices [{start}:{end}:{step}] of the split dim {dim}, which is not a run of "
                f"its blocks {s.parts} (a fused projection is sliced block by block)",
                s,
            )
        node.args, node.kwargs = (x, dim, start // self.tp, end // self.tp), {}
        return s.moved(dim, s.parts[edges.index(start):edges.index(end)])

    @rule(TP, "concat")
    def _cat(self, node: fx.Node):
        """cat / stack: operands split alike along another dim keep (move) the split, a
        replicated one is cut to this rank's part; cat along the split dim of split
        operands puts their blocks end to end (each rank holds its part of every block)."""
        tensors, n = node.args[0], val(node).dim()
        dim = full_args(node)[1] % n
        stack = node.target == aten.stack.default
        shards = [
            self.place.get(a) for a in tensors if isinstance(self.place.get(a), (Shard, list))
        ]
        if any(isinstance(p, list) for p in shards):
            raise self.refuse(node, "it concatenates an unpacked list")
        s0 = shards[0]
        if not stack and dim == s0.dim:
            places = [self.place.get(a) for a in tensors]
            if not all(isinstance(p, Shard) and p.dim == dim for p in places):
                raise self.refuse(node, "it concatenates along the split dim a value that is "
                                              "not split along it", s0)
            return s0.moved(dim, tuple(b for p in places for b in p.parts))
        if any(p.dim != s0.dim or p.parts != s0.parts for p in shards):
            raise self.refuse(node, "its operands are split differently", s0)
        for a in tensors:
            if not isinstance(self.place.get(a), Shard):
                node.replace_input_with(a, self._local_slice(node, a, s0.dim, s0))
        return s0.moved(s0.dim + (stack and dim <= s0.dim))

    @rule(TP, "index")
    def _select(self, node: fx.Node):
        """select / index_select pick along one dim: not the split one."""
        s = self.place.get(node.args[0])
        if not isinstance(s, Shard):
            raise self.refuse(node, "it indexes a replicated value with a split index")
        dim = node.args[1] % val(node.args[0]).dim()
        if dim == s.dim:
            raise self.refuse(node, f"it indexes the split dim {dim}", s)
        if node.target == aten.select.int:
            return s.moved(s.dim - (dim < s.dim))
        return s

    @rule(TP, "repeat")
    def _repeat_interleave(self, node: fx.Node):
        s = self.place[node.args[0]]
        dim = node.args[2] % val(node).dim() if len(node.args) > 2 else None
        if dim == s.dim:  # GQA: each local KV head repeated for its local query heads
            args = full_args(node)
            if args[3] is not None:  # output_size: the local one
                node.args, node.kwargs = tuple(args[:3]), {"output_size": args[3] // self.tp}
            return s.moved(dim, (val(node).shape[dim],))
        if dim is None:
            raise self.refuse(node, "it flattens the split value", s)
        return s

    @rule(TP, "tile")
    def _tile(self, node: fx.Node):
        """``x.repeat(sizes)``: the split dim repeated r times holds r copies of its blocks
        (JetMoE's keys repeated for the query heads of each attention expert), each rank
        its part of every copy; other dims keep the split (moved past new leading dims)."""
        s = self.place[node.args[0]]
        sizes = list(node.args[1])
        lead = len(sizes) - val(node.args[0]).dim()
        return s.moved(s.dim + lead, s.parts * sizes[s.dim + lead])

    @rule(TP, "attention")
    def _attention(self, node: fx.Node):
        q, k, v = (self.place.get(a) for a in node.args[:3])
        if q is None and isinstance(k, Shard) and k == v and k.dim < val(node.args[0]).dim() - 2:
            # a replicated query (JetMoE's, from whole attention experts): this rank's heads
            node.replace_input_with(node.args[0], self._local_slice(node, node.args[0], k.dim, k))
            q = k
        if not (isinstance(q, Shard) and q.dim < val(node.args[0]).dim() - 2):
            raise self.refuse(node, "query, key and value must be split alike over heads", q)
        for a, p in zip(node.args[1:3], (k, v)):
            if p == q:
                continue
            heads = val(a).shape[q.dim] if p is None else None
            # key/value heads replicated (tp_heads): this rank's
            if heads == val(node.args[0]).shape[q.dim]:
                node.replace_input_with(a, self._local_slice(node, a, q.dim))
            elif heads != 1:  # one key/value head broadcasts over every query head
                raise self.refuse(
                    node,
                    "query, key and value must be split alike over heads (or the "
                    "key/value heads replicated, one or one per query head)",
                    q,
                )
        mask = node.args[3] if len(node.args) > 3 else None
        if isinstance(mask, fx.Node) and not isinstance(self.place.get(mask), Shard):
            j = q.dim - (val(node.args[0]).dim() - val(mask).dim())
            if j >= 0 and val(mask).shape[j] != 1:
                node.replace_input_with(mask, self._local_slice(node, mask, j, q))
        return q

    @rule(TP, "exchange")
    def _exchange(self, node: fx.Node):
        """Another axis's collective along its dim argument (cp's gather of the keys): a
        split on any other dim passes through."""
        s = self.place[node.args[0]]
        if isinstance(s, Shard) and s.dim == node.args[1] % val(node.args[0]).dim():
            raise self.refuse(
                node,
                f"it exchanges dim {s.dim} over {node.args[-1]} ranks, which is split over tp "
                "ranks",
                s,
            )
        return s

    def _matmul(self, node: fx.Node):
        """The matmul family as einsum: a split dim that survives in the output (a batch
        dim such as heads, or a free dim) passes the split through, operands split alike;
        a replicated operand spanning it is cut to this rank's part. A contracting dim
        must not be split."""
        if node.target == aten.einsum.default:
            operands, (ins, out) = list(node.args[1]), einsum_letters(node)
        else:
            operands = list(node.args[:2])
            ins, out = matmul_letters(*(val(a).dim() for a in operands))
        split = None
        for a, letters in zip(operands, ins):
            p = self.place.get(a)
            if isinstance(p, list):
                raise self.refuse(node, "it multiplies an unpacked list")
            if not isinstance(p, Shard):
                continue
            if letters[p.dim] not in out:
                raise self.refuse(
                    node, f"it contracts dim {p.dim} of {a.name!r}, which is split over tp ranks "
                          "(a product over a split dim is a row-parallel linear's job)", p)
            if split is not None and (split[0] != letters[p.dim] or split[1].parts != p.parts):
                raise self.refuse(node, "its operands are split differently", p)
            split = (letters[p.dim], p)
        letter, s = split
        for a, letters in zip(operands, ins):
            if isinstance(self.place.get(a), Shard) or letter not in letters:
                continue
            j = letters.index(letter)
            if val(a).shape[j] != 1:
                node.replace_input_with(a, self._local_slice(node, a, j, s))
        return s.moved(out.index(letter))

    @rule(TP, "norm")
    def _layer_norm(self, node: fx.Node):
        """layer_norm over a split last dim: mean and variance from tp all-reduced sums,
        then the affine weight and bias split like the features."""
        s, n = self.place[node.args[0]], val(node).dim()
        x, shape, w, b, eps = full_args(node)[:5]
        if s.dim < n - len(shape):
            return s
        if len(shape) != 1:
            raise self.refuse(node, f"it normalizes over dims {list(range(n - len(shape), n))}, "
                                          f"split along dim {s.dim}", s)
        ops = []

        def add(target, *args):
            with self.g.inserting_before(node):
                ops.append(call(self.g, target, args, like=node))
            self.place[ops[-1]] = (
                s if val(ops[-1]).dim() == n and val(ops[-1]).shape[-1] != 1 else None
            )
            return ops[-1]

        def mean(v):
            local = add(aten.sum.dim_IntList, v, [-1], True)
            total = self._all_sum(local, node)
            return add(aten.div.Tensor, total, shape[0])

        xc = add(aten.sub.Tensor, x, mean(x))
        y = add(
            aten.mul.Tensor,
            xc,
            add(aten.rsqrt.default, add(aten.add.Tensor, mean(add(aten.mul.Tensor, xc, xc)), eps)),
        )
        for p, op in ((w, aten.mul.Tensor), (b, aten.add.Tensor)):
            if p is not None:
                y = add(op, y, p)
                self._elementwise(y)
        node.replace_all_uses_with(y)
        self.g.erase_node(node)
        return s

    def _all_sum(self, local: fx.Node, like: fx.Node) -> fx.Node:
        """The sum of ``local`` over tp ranks: all-reduced forward (tp_reduce); backward,
        when its readers combine it with split values (a norm's statistic), each rank holds
        the gradient of its own part and tp_copy all-reduces it (``_check_statistics``
        drops that for readers that are all replicated)."""
        copy = self.move(local, "local", "synced", at=local, after=True, like=like)
        total = self.move(copy, "partial", "replicated", at=copy, after=True, like=like)
        self.place[local] = self.place[copy] = LOCAL
        self.place[total] = None
        self.statistics.append((total, like))
        return total

    def _check_statistics(self) -> None:
        """The backward of each all-reduced sum, by its readers. A norm's statistic: all of
        them reach a split value: this rank's part of the gradient, summed over ranks (kept
        tp_copy); none does (all replicated): the same gradient on every rank, passed as it
        is (tp_copy dropped: Megatron's g). A row-parallel output (Megatron's g) whose readers
        all reach split values or this rank's slice of a replicated one (Doge's dynamic mask
        from dt_proj, cut to this rank's heads) gets a tp_copy before it: each rank holds
        the gradient of its own part, summed before the split linear reads it. Some readers
        split and some not (Jamba's x_proj: its time steps read by a column-parallel dt_proj,
        its B and C by this rank's channels; JetMoE's query, from whole attention experts on
        the residual stream, cut to this rank's heads): a tp_copy on each edge into a split
        reader instead, so the split readers' parts are summed there and the whole ones'
        gradient is added once (``_sum_into``)."""
        for total, origin in self.statistics:
            split, whole = self._readers(total)
            # total: a sum's all-reduce after its tp_copy, or a max's tp_copy
            if not split or whole:
                copy = total if total.target == fxmeg_ops.tp_copy.default else total.args[0]
                copy.replace_all_uses_with(copy.args[0])
                copy.graph.erase_node(copy)  # the graph it is in: a region's body, maybe
            if split and whole:
                self._sum_into(split)
        for total, origin in self.reductions:
            split, whole = self._readers(total)
            if split and whole:
                self._sum_into(split)
            elif split:
                copy = insert_move(
                    total.graph,
                    TP,
                    origin,
                    "partial",
                    "synced",
                    size=self.tp,
                    at=total,
                    like=origin,
                )
                total.replace_input_with(origin, copy)
                self.place[copy] = PARTIAL

    def _gradient_readers(self, start: fx.Node) -> Iterator[tuple[str, fx.Node]]:
        """Where the gradient of ``start`` comes from (``_gradient_edges``, by reader)."""
        for kind, n, _ in self._gradient_edges(start):
            yield kind, n

    def _gradient_edges(self, start: fx.Node) -> Iterator[tuple[str, fx.Node, fx.Node]]:
        """Where the gradient of ``start`` comes from: its readers, followed through
        replicated ops (into and out of region bodies; integer and boolean values pass
        none), each end as ("split", node, operand) for a split value or this rank's slice
        of a replicated one (each rank holds the gradient of its own part; once per
        replicated operand it reads on the way), ("summed", node, operand) for a tp
        collective (its backward sums over ranks, or passes a whole gradient on), and
        ("whole", node, operand) for anything else (an output)."""
        todo, seen = [(u, start) for u in start.users], {start}
        while todo:
            n, via = todo.pop()
            inner = self.through(n, seen)  # into and out of region bodies
            if inner is not None:
                todo.extend((u, _entered_from(u, n)) for u in inner if u not in seen)
                continue
            if not carries_grad(n):
                continue
            p = self.place.get(n)
            if n.target not in _SYNCED and (isinstance(p, (Shard, list)) or p is LOCAL):
                yield "split", n, via  # every edge into it: each is summed on its own (_sum_into)
                continue
            if n in seen:
                continue
            seen.add(n)
            if n.target in _SYNCED:
                yield "summed", n, via
            elif p is None and n.op == "call_function" and n.users:
                todo.extend((u, n) for u in n.users)
            else:
                yield "whole", n, via

    def _readers(self, total: fx.Node) -> tuple[list[tuple[fx.Node, fx.Node]], list[fx.Node]]:
        """The readers of all-reduced ``total``: (split reader, the replicated operand it
        reads on that path) for each edge into a value split over tp or this rank's slice of
        a replicated one; and the readers that are not (every rank holds the whole gradient)."""
        split, whole = [], []
        for kind, n, via in self._gradient_edges(total):
            if kind != "split":
                whole.append(n)
            elif (n, via) not in split:
                split.append((n, via))
        return split, whole

    def _sum_into(self, edges: list[tuple[fx.Node, fx.Node]]) -> None:
        """A tp_copy on each (split reader, operand) edge: forward the operand itself,
        backward the readers' parts summed over tp ranks."""
        for reader, operand in edges:
            copy = insert_move(
                reader.graph, TP, operand, "replicated", "synced", size=self.tp, at=reader
            )
            reader.replace_input_with(operand, copy)
            self.place[copy] = None

    @rule(TP, "softmax", "cumulative", "rank")
    def _along(self, node: fx.Node):
        """Softmax, running sums and orderings (topk, sort) along their dim: the split
        must lie elsewhere; each output (values, indices) keeps it."""
        s, n = self.place[node.args[0]], val(node.args[0]).dim()
        dims = dim_argument(node)
        dims = [dims] if isinstance(dims, int) else list(dims)
        if s.dim in {d % n for d in dims}:
            if in_family(node.target, "softmax"):
                return self._softmax_over_split(node, s)  # tp_rules_more
            raise self.refuse(
                node, f"it computes along dim {s.dim}, which is split over tp ranks", s
            )
        outputs = node.meta.get("val")
        return [s] * len(outputs) if isinstance(outputs, (tuple, list)) else s

    @rule(TP, "reduction")
    def _reduction(self, node: fx.Node):
        """Reductions (torch.Tag.reduction) by their ``dim`` argument: over other dims the
        split stays (moves); a sum or mean over the split dim is a local sum all-reduced
        over tp ranks (a mean divides it by the full size): RMSNorm's statistic."""
        s, n = self.place[node.args[0]], val(node.args[0]).dim()
        schema = [a.name for a in op_schema(node.target).arguments]
        dims = full_args(node)[schema.index("dim")] if "dim" in schema else None
        dims = list(range(n)) if dims is None or dims == [] else dims
        dims = sorted({d % n for d in ([dims] if isinstance(dims, int) else dims)})
        outputs = node.meta.get("val")  # max.dim / min.dim: (values, indices)
        first = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        keepdim = first.dim() == n
        if s.dim not in dims:
            out = s if keepdim else s.moved(s.dim - sum(d < s.dim for d in dims))
            return [out] * len(outputs) if isinstance(outputs, (tuple, list)) else out
        sums = {aten.sum.dim_IntList: None, aten.sum.default: None,
                aten.mean.dim: aten.sum.dim_IntList, aten.mean.default: aten.sum.default}
        if node.target in EXTREMES:
            return self._extreme_over_split(node, s)  # tp_rules_more
        if node.target not in sums:
            raise self.refuse(
                node,
                f"it reduces over dim {s.dim}, which is split over tp ranks (only a "
                "sum, a mean, and an amax, amin, max or min without indices are "
                "all-reduced)",
                s,
            )
        users = list(node.users)
        size = 1
        for d in dims:
            size *= val(node.args[0]).shape[d]
        out = self._all_sum(node, node)
        if sums[node.target] is not None:  # mean = all-reduced sum / full size
            node.target = sums[node.target]
            with self.g.inserting_after(out):
                out = call(self.g, aten.div.Tensor, (out, size), like=node)
            self.place[out] = None
        for user in users:
            user.replace_input_with(node, out)
        return LOCAL


def _entered_from(node: fx.Node, boundary: fx.Node) -> fx.Node:
    """The operand through which ``node`` is reached across a region boundary: a body
    placeholder it reads, or (out of a body) the region node its ``getitem`` reads."""
    if boundary.op == "output":
        return node.args[0]
    return next(a for a in node.all_input_nodes if a.op == "placeholder")


def _runs(parts: tuple[int, ...], sizes: list[int]) -> list[tuple[int, ...]] | None:
    """The blocks of ``parts`` each piece of ``sizes`` holds, laid end to end (a fused
    projection's [z, xBC, dt] over its blocks [z, x, B, C, dt]); None unless every piece
    is a run of whole blocks."""
    runs, i = [], 0
    for size in sizes:
        run = []
        while i < len(parts) and sum(run) < size:
            run.append(parts[i])
            i += 1
        if sum(run) != size:
            return None
        runs.append(tuple(run))
    return runs if i == len(parts) else None


def _bounds(start, end, size: int) -> tuple[int, int]:
    """A slice's [start, end) within a dim of ``size``, as Python clamps it."""
    start = 0 if start is None else start + size if start < 0 else start
    end = size if end is None else end + size if end < 0 else end
    return min(max(start, 0), size), min(max(end, 0), size)
