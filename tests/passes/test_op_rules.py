"""The one registry of op rules (fxmeg/passes/op_rules.py): which ops each family covers,
found by explicit entry or by tag, and which rule each parallel axis registered for it.
The table below is the registry printed: a change to a family or a rule shows here."""

import pytest
import torch
from expecttest import TestCase

from fxmeg.errors import PassError
from fxmeg.frontend.pass_driver import transform
from fxmeg.ir.ops import CP, TP
from fxmeg.passes import context_parallel, tensor_parallel  # noqa: F401  (register their rules)
from fxmeg.passes.op_rules import FAMILIES, family_of, rules
from tests.harness.helpers import make_batch

aten = torch.ops.aten


def _table() -> str:
    tp, cp = rules(TP), rules(CP)
    rows = []
    for f in FAMILIES:
        names = sorted(str(op).removeprefix("aten.") for op in f.ops)
        names += [f"tag {f.tag.name}"] if f.tag is not None else []
        rule = [
            r.fn.__name__ + ("*" if r.always else "") if r else "-"
            for r in (tp.get(f.name), cp.get(f.name))
        ]
        rows.append(f"{f.name:<16} tp {rule[0]:<20} cp {rule[1]:<14} {', '.join(names)}")
    return "\n".join(rows)


class Registry(TestCase):
    def test_families_and_the_rule_of_each_axis(self):
        """``*``: the rule runs even when no input is split (it starts a split)."""
        self.assertExpectedInline(_table(), """\
copy             tp _same                cp _elementwise   _to_copy.default, alias.default, clone.default, contiguous.default, detach.default, empty_like.default, full_like.default, ones_like.default, to.device, to.dtype, to.dtype_layout, type_as.default, zeros_like.default
random           tp _same                cp _elementwise   bernoulli.default, bernoulli.p, dropout.default, native_dropout.default, rand_like.default, randn_like.default
pointwise        tp _elementwise         cp _elementwise   complex.default, masked_fill.Tensor, polar.default, where.ScalarOther, where.ScalarSelf, tag pointwise
view             tp _reshape             cp _reshape       _unsafe_view.default, expand.default, flatten.using_ints, reshape.default, squeeze.default, squeeze.dim, unflatten.int, unsqueeze.default, view.default
complex          tp _complex_view        cp _complex_view  view_as_complex.default, view_as_real.default
permute          tp _permute             cp _permute       permute.default, t.default, transpose.int
split            tp _split               cp _along         chunk.default, split.Tensor, split_with_sizes.default
slice            tp _slice               cp _along         slice.Tensor
index            tp _select              cp _along         index_select.default, select.int
unbind           tp _unbind              cp _along         unbind.int
advanced_index   tp _advanced_index      cp -              index.Tensor
repeat           tp _repeat_interleave   cp _along         repeat_interleave.self_int
tile             tp _tile                cp -              repeat.default
scatter          tp -                    cp _along         scatter.src, scatter.value, scatter_.src, scatter_.value
gather           tp -                    cp _along         gather.default
concat           tp _cat                 cp _cat           cat.default, stack.default
softmax          tp _along               cp _along         _log_softmax.default, _safe_softmax.default, _softmax.default, log_softmax.int, softmax.int
cumulative       tp _along               cp _along         cumprod.default, cumsum.default, logcumsumexp.default
rank             tp _along               cp _along         argsort.default, argsort.stable, sort.default, sort.stable, topk.default
reduction        tp _reduction           cp _reduction     tag reduction
histogram        tp -                    cp _histogram     bincount.default, histc.default
linear           tp _product*            cp _linear        addmm.default, linear.default
matmul           tp _product*            cp _linear        bmm.default, einsum.default, matmul.default, mm.default
add_matmul       tp _add_matmul          cp _add_matmul    baddbmm.default
attention        tp _attention           cp _attention     fxmeg.cp_attention.default, fxmeg.cp_ring_attention.default, scaled_dot_product_attention.default
norm             tp _layer_norm          cp _layer_norm    layer_norm.default
embedding        tp _embedding*          cp _embedding     embedding.default
loss             tp _loss                cp _loss          cross_entropy_loss.default, nll_loss.default, nll_loss_nd.default
pad              tp _pad                 cp _pad_or_triangle constant_pad_nd.default, pad.default
triangle         tp _triangle            cp _pad_or_triangle tril.default, triu.default
write            tp _write               cp _write         copy_.default
new              tp _new                 cp _new           new_empty.default, new_full.default, new_ones.default, new_zeros.default
convolution      tp _convolution         cp _convolution   conv1d.default, conv2d.default, convolution.default
exchange         tp _exchange            cp -              fxmeg.cp_from_heads.default, fxmeg.cp_gather.default, fxmeg.cp_reduce_scatter.default, fxmeg.cp_slice.default, fxmeg.cp_to_heads.default, fxmeg.cp_unslice.default""")  # noqa: E501 (expected text, compared whole)


def test_each_explicit_op_is_in_one_family():
    seen = {}
    for f in FAMILIES:
        for op in f.ops:
            assert op not in seen, f"{op} is in families {seen[op]!r} and {f.name!r}"
            seen[op] = f.name


def test_ops_are_found_by_tag_after_explicit_entries():
    assert family_of(aten.hypot.default).name == "pointwise"  # by torch.Tag.pointwise
    assert family_of(aten.amax.default).name == "reduction"  # by torch.Tag.reduction
    assert family_of(aten.clone.default).name == "copy"  # tagged pointwise, but a copy first
    assert family_of(aten.roll.default) is None


class _UpDown(torch.nn.Module):
    """One block of a column- and a row-parallel linear; ``inner`` is what runs between
    them on the split hidden value."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(128, 16)
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict(
            {"up": torch.nn.Linear(16, 32), "down": torch.nn.Linear(32, 16)})])
        self.head = torch.nn.Linear(16, 128)

    def forward(self, ids, labels):
        x = self.emb(ids)
        x = x + self.layers[0]["down"](self.inner(self.layers[0]["up"](x)))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class _Roll(_UpDown):
    """A roll (an op of no family) of the split hidden value."""

    def inner(self, h):
        return torch.roll(h, 1, dims=1)


@pytest.mark.parametrize("axis", ["tp", "cp"])
def test_an_op_with_no_rule_is_refused_by_name_on_every_axis(axis):
    """One refusal path for every axis: the same words, the axis named."""
    title = {"tp": "tensor", "cp": "context"}[axis]
    with pytest.raises(
        PassError,
        match=rf"cannot split node 'roll' \(roll.default.*over {axis}=2 ranks.*"
        rf"fxmeg has no {title}-parallel rule for it",
    ):
        transform(_Roll(), make_batch(2, seed=0), **{axis: 2})


class ZerosLike(_UpDown):
    """An accumulator made with ``zeros_like`` of a split value (as MoE blocks sum their
    experts' outputs): the op had no rule on either axis until one line in op_rules.py
    put it in the ``copy`` family."""

    def inner(self, h):
        return torch.zeros_like(h) + h.relu()


@pytest.mark.parametrize("axis,local", [("tp", (2, 16, 16)), ("cp", (2, 8, 32))])
def test_one_family_entry_gives_an_op_a_rule_on_every_axis(axis, local):
    """(batch 2, seq 16, hidden 32): tp=2 splits the features, cp=2 the sequence."""
    gm = transform(ZerosLike(), make_batch(2, seed=0), stop_after="tensor_parallel", **{axis: 2})
    (node,) = [n for n in gm.graph.nodes if n.target == aten.zeros_like.default]
    assert tuple(node.meta["val"].shape) == local


class Unbind(_UpDown):
    """The split hidden value and its tanh stacked along a new leading dim, then unbound
    there again (as a fused q / k pair unpacks): each piece keeps the split, moved past the
    removed dim. cp had no rule for ``unbind`` until it joined ``_along``."""

    def inner(self, h):
        a, b = torch.stack((h, h.tanh()), 0).unbind(0)
        return a * b


@pytest.mark.parametrize("axis,local", [("tp", (2, 16, 16)), ("cp", (2, 8, 32))])
def test_unbind_keeps_the_split_on_every_axis(axis, local):
    gm = transform(Unbind(), make_batch(2, seed=0), stop_after="tensor_parallel", **{axis: 2})
    (node,) = [n for n in gm.graph.nodes if n.target == aten.unbind.int]
    assert [tuple(v.shape) for v in node.meta["val"]] == [local, local]


class ComplexRotary(_UpDown):
    """A rotary embedding in complex numbers, as Llama 4 writes it: the hidden value as
    (batch, seq, 4 heads, 4 pairs) through ``view_as_complex``, times a per-position
    table, back through ``view_as_real``. The table is a buffer, or (``from_input``) made
    by ``torch.polar`` from angles computed from an input (as from position_ids passed in:
    split along the sequence under cp). ``pairs_split``: the value read as 16 pairs of
    features 16 apart, so a column split lands on the pair dim (refused under tp)."""

    def __init__(self, pairs_split: bool = False, from_input: bool = False):
        super().__init__()
        self.pairs_split, self.from_input = pairs_split, from_input
        self.register_buffer("freqs", torch.tensor([1.0, 0.3, 0.1, 0.03]), persistent=False)
        angles = torch.arange(16.0)[:, None] * self.freqs
        # (seq, pairs)
        self.register_buffer("table", torch.polar(torch.ones(16, 4), angles), persistent=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        x = x + self.layers[0]["down"](self.rotate(self.layers[0]["up"](x), ids))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

    def rotate(self, h, ids):
        b, s, _ = h.shape
        if self.pairs_split:
            # (b, s, 16, 2): the pair dim split
            pairs = h.view(b, s, 2, 16).transpose(2, 3).contiguous()
            return (
                torch.view_as_real(torch.view_as_complex(pairs) * self.table[:s, :1])
                .transpose(2, 3)
                .reshape(b, s, 32)
            )
        if self.from_input:
            angles = (ids % 7).float()[..., None] * self.freqs  # (b, s, pairs)
            table = torch.polar(torch.ones_like(angles), angles)[:, :, None, :]
        else:
            table = self.table[None, :s, None, :]
        x = torch.view_as_complex(h.float().reshape(b, s, 4, 4, 2))  # (b, s, heads, pairs)
        return torch.view_as_real(x * table).flatten(3).reshape(b, s, 32)


@pytest.mark.parametrize("axis,from_input,local", [
    ("tp", False, (2, 16, 2, 4, 2)), ("cp", False, (2, 8, 4, 4, 2)), ("cp", True, (2, 8, 4, 4, 2))])
def test_a_complex_rotary_keeps_the_split_of_heads_or_positions(axis, from_input, local):
    """tp=2 splits the heads (4 -> 2 a rank) through view_as_complex and back; cp=2 the
    sequence, a complex table of every position cut to this rank's (``cp_slice``), one
    made by ``polar`` from split angles split with them."""
    gm = transform(
        ComplexRotary(from_input=from_input),
        make_batch(2, seed=0),
        stop_after="tensor_parallel",
        **{axis: 2},
    )
    (real,) = [n for n in gm.graph.nodes if n.target == aten.view_as_real.default]
    assert tuple(real.meta["val"].shape) == local
    cut = [n for n in gm.graph.nodes if n.target == torch.ops.fxmeg.cp_slice.default]
    assert [n.meta["val"].dtype for n in cut] == (
        [torch.complex64] if axis == "cp" and not from_input else []
    )


def test_a_complex_view_of_the_split_features_as_pairs_is_refused():
    with pytest.raises(
        PassError,
        match=r"cannot split node 'view_as_complex' .* it reads the split dim 3 as "
        r"\(real, imaginary\) pairs",
    ):
        transform(ComplexRotary(pairs_split=True), make_batch(2, seed=0), tp=2)
