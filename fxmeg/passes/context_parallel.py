"""Context-parallel pass: every sequence split over cp ranks, attention exchanging keys
and values, on the ATen graph of an unmodified model. The driver is the one sharding
propagation (fxmeg/passes/propagation.py) configured for cp: values split along the
sequence are ``Seq`` s; the layout, the masks, the refusals in full:
docs/architecture.md §8.11.

Requires: the loss pass's sums over tokens, on the whole graph (before tensor_parallel
and partition); (batch, seq, ...) inputs, s dim 1 of the first input of two or more dims.
Ensures, for every cp rank alike (``fxmeg::cp_*`` ops on the group "cp"): rank r holds
chunks r and 2 * cp - 1 - r of 2 * cp (``gm.meta["fxmeg"]["cp"]``, a ``CPLayout``, tells
the runtime how to cut each input); shape arguments along the sequence local; position
tables cut where they meet the local sequence (``cp_slice``); every causal attention
``cp_attention``, other masks' rows cut; loss outputs sums over this rank's tokens;
``meta["val"]`` local. An op mixing positions outside attention, a mask depending on a
split input, or an output every rank would count whole is a PassError naming the node.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from fxmeg.config import ParallelConfig
from fxmeg.errors import PassError
from fxmeg.ir.layouts import PARTIAL, CPLayout, Seq
from fxmeg.ir.ops import CP
from fxmeg.ir.tags import set_tag
from fxmeg.passes.cp.attention import attention_product
from fxmeg.passes.cp.masks import mask_inputs
from fxmeg.passes.cp.moe import SUMS, only_counted, partial, routed_experts
from fxmeg.passes.graph_utils import (
    divide_shape_arg,
    expand_add_matmul,
    finish,
    full_args,
    requires_grad_nodes,
    val,
)
from fxmeg.passes.op_rules import LINEAR_SLOTS, SHAPE_ARGUMENT, dim_argument, in_family, rule
from fxmeg.passes.propagation import UNDECIDED, Propagation
from fxmeg.passes.tp.placement import dim_groups, divisors
from fxmeg.torch_private import op_schema

aten = torch.ops.aten
fx_ops = torch.ops.fxmeg
# Ops are handled by kind: fxmeg/passes/op_rules.py finds each op's family and the rule
# this pass registered for it (``@rule(CP, ...)`` below). A place of PARTIAL is a sum over
# this rank's tokens: only a graph output may be one.


def context_parallel(gm: fx.GraphModule, parallel: ParallelConfig) -> fx.GraphModule:
    """Split ``gm``'s sequences over ``parallel.cp`` ranks (module docstring)."""
    cp = parallel.cp
    if cp == 1:
        return gm
    _ContextParallel(gm, parallel).run()
    return finish(gm)


class _ContextParallel(Propagation):
    """The driver configured for cp: values split along the sequence are ``Seq`` s."""

    axis, title, split_kinds, split_phrase = CP, "context-parallel", (Seq,), "along the sequence"

    def __init__(self, gm: fx.GraphModule, parallel: ParallelConfig) -> None:
        cp = parallel.cp
        super().__init__(gm, cp)
        self.cp, self.parallel = cp, parallel
        self.grads = requires_grad_nodes(gm)  # values a gradient flows through
        self.cut: dict[tuple[fx.Node, int], fx.Node] = {}  # (replicated value, dim) -> cp_slice
        inputs = [n for n in self.g.nodes if n.op == "placeholder"]
        first = next((n for n in inputs if val(n) is not None and val(n).dim() >= 2), None)
        if first is None:
            raise PassError(
                f"cp={cp} needs a (batch, seq, ...) input to split along the sequence; the inputs "
                f"are {[(n.name, tuple(val(n).shape)) for n in inputs if val(n) is not None]}"
            )
        self.seq = val(first).shape[1]
        if self.seq % (2 * cp):
            fits = [c for c in divisors(self.seq // 2) if c > 1] or [1]
            raise PassError(
                f"sequence length {self.seq} (dim 1 of input {first.name!r}) is not divisible by 2 "
                f"* cp = {2 * cp}: context parallelism cuts every sequence into 2 * cp equal "
                f"chunks (rank r holds chunks r and {2 * cp - 1} - r); pad the sequences to a "
                f"multiple of {2 * cp} (e.g. {-(-self.seq // (2 * cp)) * 2 * cp}) or choose cp in "
                f"{fits}"
            )
        along = [
            n
            for n in inputs
            if val(n) is not None and val(n).dim() >= 2 and val(n).shape[1] == self.seq
        ]
        self.masks = mask_inputs(self.g, along, self.seq)  # padding masks stay whole
        dims = []
        for n in inputs:
            split = n in along and n not in self.masks.whole
            dims.append(1 if split else None)
            if split:
                self.place[n] = Seq(1)
        shifts = tuple(self._shift(n) if d is not None else None for n, d in zip(inputs, dims))
        set_tag(gm, "cp", CPLayout(self.seq, cp, tuple(dims), shifts))

    def _shift(self, x: fx.Node) -> float | None:
        """An input whose only use is a shift left by one position along the sequence
        (Hugging Face's labels: ``pad(labels, [0, 1], value=-100)[:, 1:]``): the shift
        needs the next rank's first label, so the runtime shifts the whole sequence
        before the cut (as Megatron's data loader does) and the graph reads the input
        directly. Returns the fill value, or None."""
        users = list(x.users)
        if len(users) != 1 or users[0].target not in (
            aten.pad.default,
            aten.constant_pad_nd.default,
        ):
            return None
        pad = users[0]
        args = full_args(pad)
        fill = args[3] if pad.target == aten.pad.default else args[2]
        if pad.target == aten.pad.default and args[2] != "constant":
            return None
        if val(x).dim() != 2 or list(args[1]) != [0, 1] or len(pad.users) != 1:
            return None
        cut = next(iter(pad.users))
        if cut.target != aten.slice.Tensor:
            return None
        dim, start, end, step = full_args(cut)[1:]
        if dim % 2 != 1 or start != 1 or step != 1 or (end is not None and end < self.seq + 1):
            return None
        cut.replace_all_uses_with(x)
        self.g.erase_node(cut)
        self.g.erase_node(pad)
        return float(fill if fill is not None else 0.0)

    # ------------------------------------------------------------------ driver

    def run(self) -> None:
        self.tokens_of = routed_experts(self)
        self.propagate()
        self.refresh()

    def before_rules(self, node: fx.Node, places: list):
        """A routed-experts block's node is computed per token (``cp_moe``); a node
        reading a sum over this rank's tokens follows ``cp_moe.partial``."""
        if node in self.tokens_of:
            return self.place.get(self.tokens_of[node])
        if PARTIAL in places:
            if self.gm is not self.root:  # which sums need a gradient: known at the root only
                raise self.mixes(
                    node, "it reads a sum over this rank's part of the sequence inside a region "
                          "(autocast, no-grad or wrap): a router loss is carried over the cp "
                          "ranks outside regions only",
                    fix="compute the router loss outside the region, or use cp=1")
            return partial(self, node)
        return UNDECIDED

    @property
    def phrase(self) -> str:
        return f"along the sequence over cp={self.cp} ranks"

    def hint(self, node: fx.Node) -> str:
        return self.masks.hint(node)

    def mixes(self, node: fx.Node, why: str, fix: str | None = None) -> PassError:
        """The refusal of an op that mixes positions outside attention."""
        return self.refuse(
            node,
            f"it mixes positions outside attention: {why}",
            fix=fix or "compute it per position, move it into the attention, or use cp=1",
        )

    # ------------------------------------------------------------------ rules

    def _seq(self, node: fx.Node, a: fx.Node) -> Seq:
        s = self.place[a]
        if not isinstance(s, Seq):
            raise self.refuse(node, f"operand {a.name!r} is a list of values")
        return s

    @rule(CP, "copy", "random", "pointwise")
    def _elementwise(self, node: fx.Node) -> Seq:
        """Operands broadcast against each other: their sequence dims must line up; a
        replicated operand spanning the sequence dim is position-indexed (a rotary table,
        position embeddings) and is cut to this rank's positions."""
        out_dim = val(node).dim()
        found = {s.shifted(out_dim - val(a).dim())
                 for a in node.all_input_nodes if isinstance(s := self.place.get(a), Seq)}
        scores = [s for s in found if s.full is not None]
        if len(scores) == 1 and self._one_per_query(node, scores[0], out_dim):
            found = set(scores)
        if len(found) != 1:
            raise self.mixes(
                node, f"its operands hold the sequence in different dims {sorted(found, key=str)}"
            )
        (s,) = found
        for a in node.all_input_nodes:
            if isinstance(self.place.get(a), Seq) or val(a) is None:
                continue
            j = s.dim - (out_dim - val(a).dim())
            if j < 0 or val(a).shape[j] == 1:
                continue
            if s.merged or val(a).shape[j] != self.seq:
                raise self.mixes(
                    node,
                    f"operand {a.name!r} {tuple(val(a).shape)} spans dim {j}, which "
                    f"meets the sequence but is not a per-position table of length {self.seq}",
                )
            node.replace_input_with(a, self._cut(a, j, node))
        return s

    def _cut(self, a: fx.Node, dim: int, user: fx.Node) -> fx.Node:
        """``a``'s rows at this rank's positions along ``dim`` (one node per value and dim,
        inserted before its first user)."""
        if (a, dim) not in self.cut:
            self.cut[(a, dim)] = self.move(a, "replicated", "seq", dim=dim, at=user)
        return self.cut[(a, dim)]

    @rule(CP, "view")
    def _reshape(self, node: fx.Node) -> Seq:
        s = self._seq(node, node.args[0])
        a, b = tuple(val(node.args[0]).shape), tuple(val(node).shape)
        if node.target == aten.expand.default:
            lead = len(b) - len(a)
            sizes = list(node.args[1])
            if sizes[s.dim + lead] != -1:
                sizes[s.dim + lead] //= self.cp
            node.args = (node.args[0], sizes, *node.args[2:])
            return s.shifted(lead)
        if s.full is not None:  # attention scores (queries x all keys): only the dims before them
            n = len(a)
            if (s.dim, s.full) != (n - 2, n - 1) or a[-2:] != b[-2:]:
                raise self.mixes(node, "it reshapes attention scores (queries x all keys)")
            if node.target in SHAPE_ARGUMENT:  # heads in or out of the batch (Bloom's baddbmm)
                divide_shape_arg(node, len(b) - 2, self.cp)
            return Seq(len(b) - 2, full=len(b) - 1)
        if len(b) == 1 and b[0] == math.prod(a) and only_counted(node):
            # flattened to be counted (a router loss's expert ids): order is moot
            return Seq(0, merged=True)
        moved = self._moved(node, s, a, b)
        if node.target in SHAPE_ARGUMENT:
            divide_shape_arg(node, moved.dim, self.cp)
        return moved

    def _moved(self, node: fx.Node, s: Seq, a: tuple[int, ...], b: tuple[int, ...]) -> Seq:
        """Where a reshape from ``a`` to ``b`` (global shapes) puts the sequence: kept
        alone, merged into the batch dims before it, or unmerged from them again."""
        for gi, gj in dim_groups(a, b):
            if s.dim not in gi:
                continue
            ins = [d for d in gi if a[d] != 1]
            outs = [d for d in gj if b[d] != 1]
            if not outs or ins[-1] != s.dim:
                break  # merged with dims inside it (s * heads): positions mix with features
            if len(ins) == 1 and len(outs) == 1:
                return Seq(outs[0], s.merged)
            if len(outs) == 1 and not s.merged:
                return Seq(outs[0], merged=True)  # (b, s) -> (b * s)
            if len(ins) == 1 and s.merged and b[outs[-1]] == self.seq:
                return Seq(outs[-1])  # (b * s) -> (b, s)
            break
        raise self.mixes(
            node,
            f"it reshapes {a} -> {b}, which cuts or merges the sequence dim {s.dim} "
            "with dims other than the batch dims before it",
        )

    @rule(CP, "permute")
    def _permute(self, node: fx.Node) -> Seq:
        s, n = self._seq(node, node.args[0]), val(node).dim()
        if node.target == aten.transpose.int:
            i, j = node.args[1] % n, node.args[2] % n
            where = {i: j, j: i}
        elif node.target == aten.t.default:
            where = {0: 1, 1: 0}
        else:
            where = {d % n: k for k, d in enumerate(node.args[1])}
        full = None if s.full is None else where.get(s.full, s.full)
        return Seq(where.get(s.dim, s.dim), s.merged, full)

    @rule(CP, "complex")
    def _complex_view(self, node: fx.Node) -> Seq:
        """``view_as_complex`` / ``view_as_real`` (a complex rotary embedding: the pairs of
        the head dim as complex numbers) keep every dim but the trailing pair, the sequence
        among them; the rotary table is cut to this rank's positions where it meets them
        (``_elementwise``). The pair dim (size 2) never holds the sequence: its length is
        a multiple of 2 * cp."""
        return self._seq(node, node.args[0])

    @rule(CP, "embedding")
    def _embedding(self, node: fx.Node) -> Seq:
        if isinstance(self.place.get(node.args[0]), Seq):
            raise self.refuse(node, "its table is split along the sequence")
        return self._seq(node, node.args[1])

    @rule(CP, "linear", "matmul")
    def _linear(self, node: fx.Node) -> Seq:
        """A product with one operand along the sequence and the other replicated (a
        weight): the sequence must not be contracted. Two operands along the sequence are
        eager attention (``_attention_product``)."""
        if node.target == aten.einsum.default:
            raise self.refuse(node, "it is an einsum over a value split along the sequence")
        slots = LINEAR_SLOTS.get(node.target)
        x = node.args[slots.x if slots is not None else 0]
        others = [a for a in node.all_input_nodes if a is not x]
        if node.target in (aten.matmul.default, aten.bmm.default) and all(
                isinstance(self.place.get(a), Seq) for a in node.args[:2]):
            return attention_product(self, node)
        if any(isinstance(self.place.get(a), Seq) for a in others) or not isinstance(
            self.place.get(x), Seq
        ):
            raise self.mixes(
                node,
                "it multiplies a value along the sequence with one that is not its "
                "weight in a way fxmeg does not split",
            )
        s, n = self._seq(node, x), val(x).dim()
        if s.dim == n - 1 or s.full is not None:
            raise self.mixes(node, "it contracts the sequence dim")
        return s.shifted(val(node).dim() - n)

    @rule(CP, "add_matmul")
    def _add_matmul(self, node: fx.Node):
        """``baddbmm`` as ``beta * input + alpha * (a @ b)`` (``expand_add_matmul``), each
        part by its own rule: Bloom's scores, ALiBi's bias (per key: whole along the keys,
        broadcast over the queries) plus ``q @ k^T`` of eager attention."""
        for n in (new := expand_add_matmul(node)):
            self.place[n] = self.visit(n)
        return self.place[new[-1]]

    @rule(CP, "convolution")
    def _convolution(self, node: fx.Node):
        """Refused: each position needs its neighbours on the rank before. In a state-space
        or linear-attention layer (Mamba, Gated DeltaNet) a short causal convolution over
        time comes before the recurrence, which would need the state passed between ranks."""
        raise self.mixes(
            node,
            "a convolution over a value split along the sequence mixes neighbouring "
            "positions across ranks (in a state-space or linear-attention layer it "
            "precedes a recurrence over time, whose state fxmeg does not pass between "
            "cp ranks)",
            fix="use cp=1 for this model (tp and pp split such layers by heads and by layers)",
        )

    @rule(CP, "pad", "triangle")
    def _pad_or_triangle(self, node: fx.Node) -> Seq:
        """A constant pad, or a triangle of the last two dims: fine on other dims than
        the sequence; on it they shift or mask positions against one another (a chunked
        scan pads the sequence to whole chunks)."""
        s, n = self._seq(node, node.args[0]), val(node).dim()
        if in_family(node.target, "pad"):
            along = {n - 1 - i // 2 for i, w in enumerate(node.args[1]) if w}
        else:
            along = {n - 2, n - 1}
        if s.dim in along or s.full in along:
            op = getattr(node.target, "__name__", str(node.target))
            raise self.mixes(node, f"it computes along dim {s.dim}, the sequence ({op})")
        return s

    @rule(CP, "new")
    def _new(self, node: fx.Node):
        """``x.new_empty(sizes)`` and kin: sized like ``x`` along the sequence, it is split
        there too; otherwise it holds no positions of ``x`` (replicated)."""
        s, sizes, x = self._seq(node, node.args[0]), list(node.args[1]), val(node.args[0])
        if (
            s.merged
            or s.full is not None
            or len(sizes) != x.dim()
            or sizes[s.dim] != x.shape[s.dim]
        ):
            return None
        sizes[s.dim] //= self.cp
        node.args = (node.args[0], sizes, *node.args[2:])
        return s

    @rule(CP, "write")
    def _write(self, node: fx.Node) -> Seq:
        """``copy_(dst, src)`` in place: both split alike along the sequence."""
        (dst, src), lead = node.args[:2], val(node).dim() - val(node.args[1]).dim()
        d, s = self.place.get(dst), self.place.get(src)
        spans = (
            not isinstance(s, Seq)
            and isinstance(d, Seq)
            and d.dim >= lead
            and val(src).shape[d.dim - lead] != 1
        )
        if not isinstance(d, Seq) or spans or (isinstance(s, Seq) and s.shifted(lead) != d):
            raise self.refuse(
                node, "it writes a value into one split differently along the sequence"
            )
        return d

    @rule(CP, "loss")
    def _loss(self, node: fx.Node):
        """A per-token loss: the sequence stays; summed (the loss pass's reduction) it is
        this rank's part of the sum."""
        args = full_args(node)
        target = args[1]
        x = self._seq(node, args[0])
        if x.full is not None or not isinstance(self.place.get(target), Seq):
            raise self.mixes(node, "its input is split along the sequence but its target is not")
        if val(args[0]).dim() > 1 and x.dim == 1:
            raise self.mixes(node, f"its class dim {x.dim} holds the sequence")
        reduction = args[3]
        if reduction == 0:
            return self.place[target]
        if reduction == 2:
            return PARTIAL
        raise self.mixes(
            node, "it takes a mean over part of the sequence (the loss pass writes sums)"
        )

    @rule(CP, "histogram")
    def _histogram(self, node: fx.Node):
        """Counts into bins (a router's tokens per expert) over this rank's tokens: a part
        of the count over the whole sequence."""
        return PARTIAL

    @rule(CP, "norm")
    def _layer_norm(self, node: fx.Node) -> Seq:
        s = self._seq(node, node.args[0])
        if s.dim >= val(node.args[0]).dim() - len(node.args[1]) or s.full is not None:
            raise self.mixes(node, "it normalises over the sequence dim")
        return s

    @rule(
        CP,
        "split",
        "slice",
        "index",
        "unbind",
        "repeat",
        "scatter",
        "gather",
        "softmax",
        "cumulative",
        "rank",
    )
    def _along(self, node: fx.Node):
        """Ops along one dim (softmax, cumsum, split, slice, select, unbind, repeat, a router's
        top-k or sort, or its scatter of the top-k scores into a row): fine along another
        dim than the sequence; along it they mix positions (a slice of all of it is the
        value itself)."""
        s, n = self._seq(node, node.args[0]), val(node.args[0]).dim()
        dim = dim_argument(node, 0) % n
        if in_family(node.target, "gather") and self.place.get(node.args[2]) != s:
            raise self.mixes(node, "it gathers with an index not split as its input is")
        if s.full is not None and dim == s.full:
            if in_family(node.target, "softmax") or node.target == aten.slice.Tensor:
                return s  # a softmax over all keys; some of them (all are on every rank)
            raise self.mixes(node, f"it computes along dim {dim}, the keys of attention scores")
        if dim != s.dim:
            if node.target in (aten.select.int, aten.unbind.int):  # the dim goes
                if s.full is not None:
                    raise self.mixes(node, "it selects from attention scores")
                kept = Seq(s.dim - (dim < s.dim), s.merged)
                return kept if node.target == aten.select.int else [kept] * len(node.meta["val"])
            if in_family(node.target, "split") or isinstance(node.meta["val"], (tuple, list)):
                return [s] * len(node.meta["val"])  # every piece / (values, indices)
            return s
        if node.target == aten.slice.Tensor and tuple(val(node).shape) == tuple(
            val(node.args[0]).shape
        ):
            return s
        op = getattr(node.target, "__name__", str(node.target))
        raise self.mixes(
            node,
            f"it computes along dim {dim}, the sequence ({op}: every position would "
            "need positions another rank holds)",
        )

    @rule(CP, "concat")
    def _cat(self, node: fx.Node) -> Seq:
        stack = node.target == aten.stack.default
        dim = full_args(node)[1] % val(node).dim()  # cat: operand dims; stack: the output's
        operands = list(node.args[0])
        found = {self.place[a] for a in operands if isinstance(self.place.get(a), Seq)}
        if len(found) != 1:
            raise self.mixes(node, "its operands hold the sequence in different dims")
        (s,) = found
        if s.full is not None and not (dim == s.full and not stack):
            raise self.mixes(node, "it concatenates attention scores")
        if s.full is not None:  # more keys for every query (GPT-OSS's sinks): per query row
            for a in operands:
                if self.place.get(a) != s:
                    node.replace_input_with(a, self._per_query(node, a, s))
            return s
        out = Seq(s.dim + (dim <= s.dim), s.merged) if stack else s
        if dim == s.dim and not stack:
            raise self.mixes(node, "it concatenates along the sequence")
        for a in operands:
            if not isinstance(self.place.get(a), Seq):
                if val(a).shape[s.dim] != self.seq or s.merged:
                    raise self.mixes(node, f"operand {a.name!r} is not split along the sequence")
                node.replace_input_with(a, self._cut(a, s.dim, node))
        return out

    def _one_per_query(self, node: fx.Node, s: Seq, out_dim: int) -> bool:
        """Every sequence-split operand of ``node`` but the attention scores ``s`` holds one
        entry over their keys for each query (their max over the keys, kept as a dim): it
        broadcasts over the keys, which every rank holds whole."""
        for a in node.all_input_nodes:
            p = self.place.get(a)
            if not isinstance(p, Seq):
                continue
            shift = out_dim - val(a).dim()
            q = p.shifted(shift)
            if q == s:
                continue
            if q.full is not None or q.merged or q.dim != s.dim:
                return False
            if val(a).shape[s.full - shift] != 1:
                return False
        return True

    def _per_query(self, node: fx.Node, a: fx.Node, s: Seq) -> fx.Node:
        """Operand ``a`` of attention scores' concatenation along the keys: whole (every
        query's row of it, or one row for all), cut to this rank's queries."""
        rows = val(a).shape[s.dim]
        if isinstance(self.place.get(a), (Seq, list)) or rows not in (1, self.seq):
            raise self.mixes(node, f"operand {a.name!r} is not one row per query")
        return a if rows == 1 else self._cut(a, s.dim, node)

    @rule(CP, "reduction")
    def _reduction(self, node: fx.Node):
        s, n = self._seq(node, node.args[0]), val(node.args[0]).dim()
        schema = [a.name for a in op_schema(node.target).arguments]
        dims = full_args(node)[schema.index("dim")] if "dim" in schema else None
        dims = list(range(n)) if dims is None or dims == [] else dims
        dims = sorted({d % n for d in ([dims] if isinstance(dims, int) else dims)})
        if s.dim not in dims:
            outs = node.meta["val"]  # max / min along a dim: (values, indices)
            first = outs[0] if isinstance(outs, (tuple, list)) else outs
            keepdim = first.dim() == n
            # over all keys (a softmax written out): exact
            if s.full is not None and s.full in dims:
                s = Seq(s.dim, s.merged)
            elif s.full is not None:
                raise self.mixes(node, "it reduces attention scores over a dim other than the keys")
            kept = s if keepdim else Seq(s.dim - sum(d < s.dim for d in dims), s.merged)
            return [kept] * len(outs) if isinstance(outs, (tuple, list)) else kept
        if node.target in SUMS:
            return PARTIAL  # a token count or a summed loss; check_outputs refuses other uses
        raise self.mixes(
            node,
            f"it reduces over dim {s.dim}, the sequence (a pooling or a statistic over positions)",
        )

    # ------------------------------------------------------------------ finish

    def check_outputs(self, node: fx.Node) -> None:
        """Every output is a sum over this rank's tokens (PARTIAL): the runtime sums it over
        the cp ranks. The loss pass's count of a plain mean (the global number of elements,
        a constant) becomes this rank's share; any other output that is the same on every cp
        rank would be counted cp times, and is refused."""
        for a in node.all_input_nodes:
            place = self.place.get(a)
            if isinstance(place, (Seq, list)):
                raise self.refuse(
                    a,
                    "the model returns it split along the sequence (a loss must be "
                    "a sum over tokens)",
                )
            if place is not None:
                continue
            whole = sorted(x.name for x in self.masks.deps.get(a, ()) if x in self.masks.whole)
            if whole:
                raise self.refuse(
                    a,
                    f"the model returns it computed from input(s) {whole} alone, which "
                    "every cp rank reads whole (a padding mask): summed over the cp ranks "
                    f"it would count {self.cp} times",
                    fix="count tokens from the labels (ignore_index), or cp=1",
                )
            if a.target == aten.scalar_tensor.default and a.name.startswith("num_tokens"):
                a.args = (a.args[0] / self.cp, *a.args[1:])  # a mean's count: each rank holds 1/cp
                continue
            raise self.refuse(
                a,
                "the model returns it computed from no sequence input (a constant "
                "count such as labels.numel() or ones(b, s).sum()): every cp rank would "
                f"return the whole value, and summed over the cp ranks it would count {self.cp} "
                "times",
                fix="count the tokens from the labels (e.g. (labels != -100).sum()), or cp=1",
            )

    def local_input(self, node: fx.Node):
        """A split input's local fake value (1/cp of the sequence, dim 1)."""
        if not isinstance(self.place.get(node), Seq):
            return None
        shape = list(val(node).shape)
        shape[1] //= self.cp
        return val(node).new_empty(shape)
