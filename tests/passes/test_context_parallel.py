"""The context-parallel pass on one process: what cp=2 changes in the graph (the same on
every rank: the cp ops name the symbolic group "cp" and read the rank inside), the
load-balanced layout, the layout the runtime cuts inputs by, and refusals."""

import pytest
import torch
from expecttest import TestCase
from torch import nn

from fxmeg.errors import PassError
from fxmeg.frontend.pass_driver import transform
from fxmeg.ir.ops import cp_positions
from fxmeg.runtime.batches import context_slice
from tests.harness.helpers import graph_after, graph_diff, make_batch
from tests.harness.models import make_model


def _cp_diff(name: str, cp: int = 2) -> str:
    """What the context-parallel pass changes in the graph it receives."""
    model = make_model(name, n_layer=1)
    ex = make_batch(2, seed=0)
    return graph_diff(graph_after(model, ex, "analyse", cp=cp).code,
                      graph_after(model, ex, "context_parallel", cp=cp).code)


class SplitGraphs(TestCase):
    def test_gpt_cp2(self):
        self.assertExpectedInline(
            _cp_diff("gpt"),
            """\
@@
-    add = torch.ops.aten.add.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
+    cp_slice_default = torch.ops.fxmeg.cp_slice.default(embedding_1, 0, 2, 'cp');  embedding_1 = None
+    add = torch.ops.aten.add.Tensor(embedding, cp_slice_default);  embedding = cp_slice_default = None
@@
-    view = torch.ops.aten.view.default(getitem, [2, 16, 4, 8]);  getitem = None
+    view = torch.ops.aten.view.default(getitem, [2, 8, 4, 8]);  getitem = None
@@
-    view_1 = torch.ops.aten.view.default(getitem_1, [2, 16, 4, 8]);  getitem_1 = None
+    view_1 = torch.ops.aten.view.default(getitem_1, [2, 8, 4, 8]);  getitem_1 = None
@@
-    view_2 = torch.ops.aten.view.default(getitem_2, [2, 16, 4, 8]);  getitem_2 = None
+    view_2 = torch.ops.aten.view.default(getitem_2, [2, 8, 4, 8]);  getitem_2 = None
@@
-    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
-    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
-    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 32]);  transpose_3 = None
+    cp_attention_default = torch.ops.fxmeg.cp_attention.default(transpose, transpose_1, transpose_2, None, False, 2, 'cp');  transpose = transpose_1 = transpose_2 = None
+    transpose_3 = torch.ops.aten.transpose.int(cp_attention_default, 1, 2);  cp_attention_default = None
+    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 8, 32]);  transpose_3 = None""",  # noqa: E501 (expected text, compared whole)
        )

    def test_llama_cp2(self):
        self.assertExpectedInline(
            _cp_diff("llama"),
            """\
@@
-    view = torch.ops.aten.view.default(linear, [2, 16, 4, 8]);  linear = None
+    view = torch.ops.aten.view.default(linear, [2, 8, 4, 8]);  linear = None
@@
-    view_1 = torch.ops.aten.view.default(linear_1, [2, 16, 2, 8]);  linear_1 = None
+    view_1 = torch.ops.aten.view.default(linear_1, [2, 8, 2, 8]);  linear_1 = None
@@
-    view_2 = torch.ops.aten.view.default(linear_2, [2, 16, 2, 8]);  linear_2 = None
+    view_2 = torch.ops.aten.view.default(linear_2, [2, 8, 2, 8]);  linear_2 = None
@@
-    mul_2 = torch.ops.aten.mul.Tensor(transpose, slice_1)
+    cp_slice_default = torch.ops.fxmeg.cp_slice.default(slice_1, 0, 2, 'cp');  slice_1 = None
+    mul_2 = torch.ops.aten.mul.Tensor(transpose, cp_slice_default)
@@
-    mul_3 = torch.ops.aten.mul.Tensor(cat, slice_2);  cat = None
+    cp_slice_default_1 = torch.ops.fxmeg.cp_slice.default(slice_2, 0, 2, 'cp');  slice_2 = None
+    mul_3 = torch.ops.aten.mul.Tensor(cat, cp_slice_default_1);  cat = None
@@
-    mul_4 = torch.ops.aten.mul.Tensor(transpose_1, slice_1);  slice_1 = None
+    mul_4 = torch.ops.aten.mul.Tensor(transpose_1, cp_slice_default);  cp_slice_default = None
@@
-    mul_5 = torch.ops.aten.mul.Tensor(cat_1, slice_2);  cat_1 = slice_2 = None
+    mul_5 = torch.ops.aten.mul.Tensor(cat_1, cp_slice_default_1);  cat_1 = cp_slice_default_1 = None
@@
-    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(add_1, repeat_interleave, repeat_interleave_1, None, 0.0, True);  add_1 = repeat_interleave = repeat_interleave_1 = None
-    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
-    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 32]);  transpose_3 = None
+    cp_attention_default = torch.ops.fxmeg.cp_attention.default(add_1, repeat_interleave, repeat_interleave_1, None, False, 2, 'cp');  add_1 = repeat_interleave = repeat_interleave_1 = None
+    transpose_3 = torch.ops.aten.transpose.int(cp_attention_default, 1, 2);  cp_attention_default = None
+    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 8, 32]);  transpose_3 = None""",  # noqa: E501 (expected text, compared whole)
        )


def test_megatron_load_balanced_layout():
    """2 * cp chunks; rank r holds chunks r and 2 * cp - 1 - r: every rank as many early
    (cheap) as late (expensive) causal queries."""
    assert cp_positions(16, 2, 0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(16, 4, 1) == [2, 3, 12, 13]
    assert sorted(p for r in range(4) for p in cp_positions(16, 4, r)) == list(range(16))


def test_runtime_cuts_the_inputs_the_pass_split():
    ids, labels = make_batch(2, seed=0)
    program = transform(make_model("gpt", n_layer=1), (ids, labels), cp=2)
    assert program.cp_layout.seq == 16 and program.cp_layout.dims == (1, 1)
    local = context_slice(program.cp_layout, (ids, labels), 1)
    assert torch.equal(local[0], ids[:, 4:12]) and torch.equal(local[1], labels[:, 4:12])
    spec = program.specs[0]
    assert spec.is_last  # pp=1: one chunk; its graph takes local inputs
    placeholders = [n for n in program.chunks[0].graph.nodes if n.op == "placeholder"]
    assert [tuple(n.meta["val"].shape) for n in placeholders] == [(2, 8), (2, 8)]


class _Shift(nn.Module):
    """Labels shifted inside the model (Hugging Face style): a slice along the sequence."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 128)])

    def forward(self, ids, labels):
        logits = self.layers[0](ids)[:, :-1]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 128)])
        self.conv = nn.Conv1d(128, 128, 3, padding=1)

    def forward(self, ids, labels):
        h = self.conv(self.layers[0](ids).transpose(1, 2)).transpose(1, 2)
        return nn.functional.cross_entropy(h.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    "model,words",
    [
        (_Shift, "it computes along dim 1, the sequence"),
        (
            _Conv,
            (
                "(conv1d.default, module 'conv') along the sequence over cp=2 ranks: it mixes "
                "positions outside "
                "attention: a convolution over a value split along the sequence"
            ),
        ),
    ],
)
def test_position_mixing_is_refused_naming_the_node(model, words):
    with pytest.raises(PassError, match="mixes positions outside attention") as err:
        transform(model(), make_batch(2, seed=0), cp=2)
    assert words in str(err.value) and "cannot split node '" in str(err.value)


def test_hugging_face_label_shift_and_causal_mask():
    """Hugging Face's Llama shifts its labels itself (pad, then drop the first) and builds
    its causal mask from positions: the runtime shifts the whole sequence before the cut,
    and a mask that depends on no input and equals the causal mask is causal attention."""
    ids, labels = make_batch(2, seed=0)
    program = transform(make_model("hf-llama"), (ids, labels), cp=2)
    assert program.cp_layout.shifts == (None, -100.0)
    targets = [n.target for n in program.chunks[0].graph.nodes]
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    assert targets.count(torch.ops.fxmeg.cp_attention.default) == 2  # one per layer
    local = context_slice(program.cp_layout, (ids, labels), 0)[1]
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    assert torch.equal(local, shifted[:, cp_positions(16, 2, 0)])



def test_a_model_on_meta_gets_the_same_causal_attention():
    """Captured on meta (a model built on meta, or a new input shape), the causal mask is
    made with device=meta: it is evaluated on the CPU and recognised as causal (it was an
    error, 'Tensor.item() cannot be called on meta tensors')."""
    with torch.device("meta"):
        model = make_model("hf-llama")
    program = transform(model, make_batch(2, seed=0), cp=2)
    targets = [n.target for n in program.chunks[0].graph.nodes]
    assert targets.count(torch.ops.fxmeg.cp_attention.default) == 2


def test_eager_attention_gathers_keys_and_values_and_cuts_the_mask_rows():
    """Hugging Face's eager path: scores against all-gathered keys, the additive mask's
    rows cut to this rank's queries (its key columns whole), probabilities against
    all-gathered values."""
    ids, labels = make_batch(2, seed=0)
    program = transform(make_model("hf-llama", attn_implementation="eager"), (ids, labels), cp=2)
    nodes = list(program.chunks[0].graph.nodes)
    gathers = [n for n in nodes if n.target == torch.ops.fxmeg.cp_gather.default]
    assert len(gathers) == 4  # k^T and v, two layers
    assert {(n.args[1], tuple(n.meta["val"].shape[-2:])) for n in gathers} == {
        (3, (8, 16)),
        (2, (16, 8)),
    }
    keys = [n for n in gathers if n.args[1] == 3]
    scores = [n for n in nodes if n.target == torch.ops.aten.matmul.default and n.args[1] in keys]
    # local x all
    assert len(scores) == 2 and all(tuple(n.meta["val"].shape[-2:]) == (8, 16) for n in scores)


class _Window(nn.Module):
    """SDPA under a sliding-window mask: not the causal mask."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 128)])

    def forward(self, ids, labels):
        h = self.layers[0](ids).unsqueeze(1)
        ones = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device)
        h = nn.functional.scaled_dot_product_attention(
            h, h, h, attn_mask=ones.tril() & ~ones.tril(-4)
        )
        return nn.functional.cross_entropy(h.squeeze(1).flatten(0, 1), labels.flatten())


class _Encoder(_Window):
    """SDPA with neither mask nor is_causal: every query sees every key (an encoder's)."""

    def forward(self, ids, labels):
        h = self.layers[0](ids).unsqueeze(1)
        h = nn.functional.scaled_dot_product_attention(h, h, h)
        return nn.functional.cross_entropy(h.squeeze(1).flatten(0, 1), labels.flatten())


def test_an_encoders_attention_sees_all_gathered_keys():
    """No mask, not causal: SDPA stays, of the local queries against all-gathered keys and
    values (it was refused with the fix 'use is_causal=True', which changes the model)."""
    gm = graph_after(_Encoder(), make_batch(2, seed=0), "context_parallel", cp=2)
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.fxmeg.cp_gather.default) == 2
    assert torch.ops.fxmeg.cp_attention.default not in targets
    assert torch.ops.aten.scaled_dot_product_attention.default in targets


def test_a_mask_built_from_positions_has_its_rows_cut():
    """A sliding window is not causal attention: SDPA stays, over all-gathered keys and
    values, with the mask's rows cut to this rank's queries (parity: the cp module)."""
    gm = graph_after(_Window(), make_batch(2, seed=0), "context_parallel", cp=2)
    (sdpa,) = [
        n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default
    ]
    assert [a.target for a in sdpa.args[1:4]] == [torch.ops.fxmeg.cp_gather.default] * 2 + [
        torch.ops.fxmeg.cp_slice.default]
    assert tuple(sdpa.args[3].meta["val"].shape) == (8, 16)  # local queries x all keys


class _Padding(nn.Module):
    """SDPA under a padding mask from the token ids: it depends on a split input."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 128)])

    def forward(self, ids, labels):
        h = self.layers[0](ids).unsqueeze(1)
        h = nn.functional.scaled_dot_product_attention(
            h, h, h, attn_mask=(ids != 0)[:, None, None, :]
        )
        return nn.functional.cross_entropy(h.squeeze(1).flatten(0, 1), labels.flatten())


def test_a_mask_from_the_inputs_is_refused():
    with pytest.raises(
        PassError, match="an attention with a mask that depends on the split inputs"
    ):
        transform(_Padding(), make_batch(2, seed=0), cp=2)


def _dict_batch(side: str) -> dict:
    from tests.parity.test_keyword_batches import padded

    return padded(2, seed=1, side=side)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_padding_mask_input_reaches_every_rank_whole(attn):
    """Hugging Face's attention_mask feeds attention masks alone: the runtime does not cut
    it (every cp rank reads all its keys), position_ids and the rest are cut, and the 4-D
    mask's rows are cut to this rank's queries where it meets attention (keys whole)."""
    batch = _dict_batch("left")
    program = transform(
        make_model("hf-llama", pad_token_id=0, attn_implementation=attn), batch, cp=2
    )
    assert list(batch) == ["input_ids", "attention_mask", "labels", "position_ids"]
    assert program.cp_layout.dims == (1, None, 1, 1)
    local = context_slice(program.cp_layout, tuple(batch.values()), 1)
    assert torch.equal(local[1], batch["attention_mask"]) and torch.equal(
        local[3], batch["position_ids"][:, 4:12]
    )
    cuts = [
        n for n in program.chunks[0].graph.nodes if n.target == torch.ops.fxmeg.cp_slice.default
    ]
    # one mask, 2 layers
    assert [(n.args[1], tuple(n.meta["val"].shape)) for n in cuts] == [(2, (2, 1, 8, 16))]


class _MaskTwice(nn.Module):
    """A padding mask input that feeds the attention mask and also scales the embeddings."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 128)])

    def forward(self, ids, mask, labels):
        h = (self.layers[0](ids) * mask[..., None]).unsqueeze(1)
        h = nn.functional.scaled_dot_product_attention(
            h, h, h, attn_mask=mask.bool()[:, None, None, :]
        )
        return nn.functional.cross_entropy(h.squeeze(1).flatten(0, 1), labels.flatten())


def test_a_mask_input_used_otherwise_is_refused_naming_it():
    ids, labels = make_batch(2, seed=0)
    with pytest.raises(
        PassError, match="an attention with a mask that depends on the split inputs"
    ) as err:
        transform(_MaskTwice(), (ids, torch.ones(2, 16), labels), cp=2)
    assert (
        "input 'mask' feeds the attention mask at node 'scaled_dot_product_attention' but also "
        "node 'mul'" in str(err.value)
    ), str(err.value)


class MeanSquared(nn.Module):
    """A regression loss written as a plain mean: the loss pass counts its elements."""

    def __init__(self):
        super().__init__()
        self.inp, self.qkv, self.out = nn.Linear(8, 16), nn.Linear(16, 48), nn.Linear(16, 8)

    def forward(self, x, y):
        b, s, _ = x.shape
        q, k, v = (
            t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(self.inp(x)).split(16, dim=-1)
        )
        a = (
            nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(b, s, 16)
        )
        return ((self.out(a) - y) ** 2).mean()


def regression_batches():
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 16, 8, generator=g), torch.randn(8, 16, 8, generator=g)) for _ in range(3)
    ]


def test_a_plain_means_count_is_each_ranks_share():
    """The count of ``x.mean()`` is the global number of elements, a constant: each cp rank
    counts its 1/cp, so that the runtime's sum over cp ranks is the whole (it counted cp
    times, and the loss and gradients came out divided by cp; parity: the cp module)."""
    x, y = regression_batches()[0]
    gm = graph_after(MeanSquared(), (x[:2], y[:2]), "context_parallel", cp=2)
    count = next(n for n in gm.graph.nodes if n.name.startswith("num_tokens"))
    assert count.args[0] == 2 * 16 * 8 / 2


def test_a_count_the_same_on_every_cp_rank_is_refused():
    def loss_fn(model, x, y):
        per = (model.out(model.inp(x)) - y) ** 2
        return per.sum(), torch.ones(x.shape[0], x.shape[1]).sum() * 8

    with pytest.raises(
        PassError,
        match="computed from no sequence input .* summed over the cp ranks it would count 2 times",
    ):
        transform(
            MeanSquared(), tuple(t[:2] for t in regression_batches()[0]), cp=2, loss_fn=loss_fn
        )


class _RegionRouterLoss(nn.Module):
    """A router loss (expert counts times summed probabilities, both sums over this rank's
    tokens under cp) computed inside an autocast region (``inside``) or outside it."""

    def __init__(self, inside: bool):
        super().__init__()
        self.inside = inside
        self.emb, self.router = nn.Embedding(128, 16), nn.Linear(16, 4)
        self.head = nn.Linear(16, 128)

    def forward(self, ids, labels):
        x = self.emb(ids)
        loss = nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        if self.inside:
            with torch.autocast("cpu", enabled=False):
                aux = _router_loss(self.router(x))
        else:
            aux = _router_loss(self.router(x))
        return loss + 0.01 * aux


def _router_loss(scores):
    probs = scores.softmax(-1).flatten(0, 1)
    counts = torch.histc(probs.argmax(-1).float(), bins=4, min=0, max=3)
    return (probs.sum(0) * counts).sum()  # the operand that needs a gradient first


def test_a_router_loss_inside_a_region_is_refused_not_misread():
    """Which of two sums over this rank's tokens needs a gradient is known for the root
    graph only: inside a region the product would all-reduce the wrong one, silently (the
    shared driver enters regions under cp). Refused, naming the fix; outside it is split."""
    transform(_RegionRouterLoss(inside=False), make_batch(2, seed=0), cp=2)
    with pytest.raises(PassError, match=r"cannot split node 'mul' .* inside a region .* compute "
                                        r"the router loss outside the region"):
        transform(_RegionRouterLoss(inside=True), make_batch(2, seed=0), cp=2)
