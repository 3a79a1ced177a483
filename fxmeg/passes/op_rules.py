"""One registry of op rules for every sharding pass: which family an op belongs to, and
each parallel axis's rule for that family (as PyTorch DTensor's ``register_op_strategy``
keeps its sharding rules in one place, grouped by family).

An op is found by its kind, never by a list of names alone (docs/architecture.md §3): an
explicit entry of a family first (ops whose kind no tag or schema says: casts, views,
products), then torch's tags (``torch.Tag.pointwise``, ``torch.Tag.reduction``), so an op
never seen before is handled when its kind is known. A pass registers its rule for one
or more families with ``@rule(axis, *families)``; ``rule_for(axis, op)`` finds it. An
op with no family, or a family the axis has no rule for, is refused by the pass, naming
the op (``describe``). Supporting a new op on every axis is one entry here.

Each rule is a method of the axis's pass object, called as ``rule(self, node)`` with the
node whose inputs have places; it returns the node's place (``fxmeg.ir.layouts``).
``always`` marks a rule that runs even when no input is split (a linear or an embedding
that starts a split); every other rule runs only on nodes that read a split value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from fxmeg.ir import ops as _registers_fxmeg_ops  # noqa: F401  (torch.ops.fxmeg.* below)
from fxmeg.passes.graph_utils import full_args
from fxmeg.torch_private import op_schema

aten = torch.ops.aten
fx_ops = torch.ops.fxmeg


@dataclass(frozen=True)
class Family:
    """A kind of op: every member moves a split the same way."""

    name: str
    doc: str
    ops: frozenset = frozenset()
    """Explicit members (ATen or fxmeg overloads)."""
    tag: torch.Tag | None = None
    """Members found by this tag (after every explicit member)."""


def _ops(*names: str, ns=aten) -> frozenset:
    """Overloads by ``op.overload`` name (``"view.default"``)."""
    out = set()
    for name in names:
        op, overload = name.split(".")
        out.add(getattr(getattr(ns, op), overload))
    return frozenset(out)


FAMILIES: tuple[Family, ...] = (
    Family(
        "copy",
        "shaped like their input: a cast, copy or alias of it, or constants like it",
        _ops(
            "to.dtype",
            "to.dtype_layout",
            "to.device",
            "_to_copy.default",
            "alias.default",
            "contiguous.default",
            "type_as.default",
            "detach.default",
            "clone.default",
            "zeros_like.default",
            "ones_like.default",
            "empty_like.default",
            "full_like.default",
        ),
    ),
    Family(
        "random",
        "draw random values shaped like their input (their stream matters)",
        _ops(
            "dropout.default",
            "native_dropout.default",
            "bernoulli.default",
            "bernoulli.p",
            "rand_like.default",
            "randn_like.default",
        ),
    ),
    Family(
        "pointwise",
        "elementwise over broadcast operands (masking ops and complex constructors are not tagged)",
        _ops(
            "masked_fill.Tensor",
            "where.ScalarOther",
            "where.ScalarSelf",
            "polar.default",
            "complex.default",
        ),
        torch.Tag.pointwise,
    ),
    Family(
        "view",
        "reshapes and views that keep the elements' order",
        _ops(
            "view.default",
            "reshape.default",
            "_unsafe_view.default",
            "flatten.using_ints",
            "unsqueeze.default",
            "squeeze.dim",
            "squeeze.default",
            "unflatten.int",
            "expand.default",
        ),
    ),
    Family(
        "complex",
        "pairs along the last dim read as complex numbers (view_as_complex) or spelled out as "
        "pairs again (view_as_real): every other dim stays where it is",
        _ops("view_as_complex.default", "view_as_real.default"),
    ),
    Family("permute", "reorder dims", _ops("transpose.int", "permute.default", "t.default")),
    Family(
        "split",
        "pieces along their dim argument",
        _ops("split.Tensor", "split_with_sizes.default", "chunk.default"),
    ),
    Family("slice", "a range along their dim argument", _ops("slice.Tensor")),
    Family(
        "index", "pick entries along their dim argument", _ops("select.int", "index_select.default")
    ),
    Family("unbind", "every entry along their dim argument, that dim removed", _ops("unbind.int")),
    Family(
        "advanced_index",
        "index by tensors, one per leading dim (None: all of it)",
        _ops("index.Tensor"),
    ),
    Family("repeat", "repeat entries along their dim argument", _ops("repeat_interleave.self_int")),
    Family(
        "tile", "the whole tensor repeated along each dim (Tensor.repeat)", _ops("repeat.default")
    ),
    Family(
        "scatter",
        "write values at indices along their dim argument (a router's top-k scores into a row)",
        _ops("scatter.src", "scatter_.src", "scatter.value", "scatter_.value"),
    ),
    Family(
        "gather",
        "read values at indices along their dim argument, the index shaped like the result "
        "(a group-limited router's scores of its top groups)",
        _ops("gather.default"),
    ),
    Family(
        "concat", "join operands along a dim (new for stack)", _ops("cat.default", "stack.default")
    ),
    Family(
        "softmax",
        "normalise along their dim argument",
        _ops(
            "_softmax.default",
            "softmax.int",
            "_safe_softmax.default",
            "_log_softmax.default",
            "log_softmax.int",
        ),
    ),
    Family(
        "cumulative",
        "running sums or products along their dim argument",
        _ops("cumsum.default", "cumprod.default", "logcumsumexp.default"),
    ),
    Family(
        "rank",
        "order entries along their dim argument (values and indices: a router's top-k)",
        _ops("topk.default", "sort.default", "sort.stable", "argsort.default", "argsort.stable"),
    ),
    Family(
        "reduction", "reduce over their dim argument (all dims when none)", tag=torch.Tag.reduction
    ),
    Family(
        "histogram",
        "count values into bins (a router's tokens per expert)",
        _ops("histc.default", "bincount.default"),
    ),
    Family(
        "linear",
        "a product with a weight operand and an optional bias (LINEAR_SLOTS)",
        _ops("linear.default", "addmm.default"),
    ),
    Family(
        "matmul",
        "products of two operands, read as einsum",
        _ops("mm.default", "matmul.default", "bmm.default", "einsum.default"),
    ),
    Family(
        "add_matmul",
        "a batched product added to a third operand (baddbmm)",
        _ops("baddbmm.default"),
    ),
    Family(
        "attention",
        "attention of queries over keys and values, heads in dim -3 (SDPA; fxmeg's cp_attention "
        "and cp_ring_attention)",
        _ops("scaled_dot_product_attention.default")
        | _ops("cp_attention.default", "cp_ring_attention.default", ns=fx_ops),
    ),
    Family("norm", "layer norm over the last dims", _ops("layer_norm.default")),
    Family("embedding", "rows of a table by index", _ops("embedding.default")),
    Family(
        "loss",
        "per-class losses over (tokens, classes) inputs",
        _ops("cross_entropy_loss.default", "nll_loss_nd.default", "nll_loss.default"),
    ),
    Family(
        "pad",
        "pad dims with a constant (pad widths from the last dim back)",
        _ops("pad.default", "constant_pad_nd.default"),
    ),
    Family(
        "triangle", "keep a triangle of the last two dims", _ops("tril.default", "triu.default")
    ),
    Family("write", "copy a value into (a view of) another in place", _ops("copy_.default")),
    Family(
        "new",
        "a new tensor of the sizes given, with its input's dtype and device",
        _ops("new_empty.default", "new_zeros.default", "new_ones.default", "new_full.default"),
    ),
    Family(
        "convolution",
        "mix neighbouring positions",
        _ops("convolution.default", "conv1d.default", "conv2d.default"),
    ),
    Family(
        "exchange",
        "collectives of one axis along their dim argument (cp's cut, gather, scatter of the "
        "sequence, its sequence-for-heads all-to-all): every other dim passes through",
        _ops(
            "cp_to_heads.default",
            "cp_from_heads.default",
            "cp_slice.default",
            "cp_unslice.default",
            "cp_gather.default",
            "cp_reduce_scatter.default",
            ns=fx_ops,
        ),
    ),
)
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}
_EXPLICIT: dict = {op: f for f in FAMILIES for op in f.ops}
_TAGGED: tuple[Family, ...] = tuple(f for f in FAMILIES if f.tag is not None)


@dataclass(frozen=True)
class LinearSlots:
    """Where a linear-like op keeps its operands (Hugging Face's Conv1D is
    ``addmm(bias, x, weight[in, out])``)."""

    x: int
    weight: int
    bias: int | None
    out_dim: int
    """The weight's output-feature dim."""


LINEAR_SLOTS: dict = {
    aten.linear.default: LinearSlots(0, 1, 2, 0),
    aten.addmm.default: LinearSlots(1, 2, 0, 1),
    aten.mm.default: LinearSlots(0, 1, None, 1),
}
SHAPE_ARGUMENT = _ops("view.default", "reshape.default", "_unsafe_view.default", "unflatten.int")
"""Views whose shape argument lists sizes: a pass dividing a dim rewrites it there."""


def family_of(target) -> Family | None:
    """The family of an op (an overload), or None when fxmeg knows no kind for it."""
    found = _EXPLICIT.get(target)
    if found is not None:
        return found
    tags = getattr(target, "tags", ())
    return next((f for f in _TAGGED if f.tag in tags), None)


def in_family(target, *names: str) -> bool:
    """Whether op ``target`` belongs to one of the named families."""
    found = family_of(target)
    return found is not None and found.name in names


# ---------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    fn: Callable
    always: bool = False


_RULES: dict[tuple[str, str], Rule] = {}


def rule(axis: str, *families: str, always: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated method as ``axis``'s rule for ``families``."""

    def register(fn: Callable) -> Callable:
        for name in families:
            assert name in BY_NAME, f"{fn.__qualname__}: no op family {name!r}"
            assert (axis, name) not in _RULES, f"two {axis} rules for family {name!r}"
            _RULES[(axis, name)] = Rule(fn, always)
        return fn

    return register


def rule_for(axis: str, target) -> Rule | None:
    """``axis``'s rule for op ``target``, or None (the op must then be refused)."""
    found = family_of(target)
    return None if found is None else _RULES.get((axis, found.name))


def rules(axis: str) -> dict[str, Rule]:
    """Family name -> ``axis``'s rule, for every family it has one for."""
    return {name: r for (a, name), r in _RULES.items() if a == axis}


def describe(target) -> str:
    """What kind an op without a rule is, for a refusal: 'a view', 'not an ATen op' ..."""
    found = family_of(target)
    if found is not None:
        return f"an op of family {found.name!r} ({found.doc}), which this axis has no rule for"
    schema = op_schema(target)
    if schema is None:
        return "not an ATen op"
    if any(r.alias_info for r in schema.returns):
        return "a view of no family fxmeg knows"
    return "an op of no family fxmeg knows"


def dim_argument(node: fx.Node, default: int | None = None):
    """The value of an op's ``dim`` argument, found by its schema (``default`` when the
    op has none or it is not given)."""
    names = [a.name for a in op_schema(node.target).arguments]
    if "dim" not in names:
        return default
    value = full_args(node)[names.index("dim")]
    return default if value is None else value
