import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

from fxmeg.errors import PassError
from fxmeg.frontend.capture import capture
from fxmeg.passes.loss import loss
from tests.harness.helpers import graph_after, graph_diff, make_batch
from tests.harness.models import make_model


def _loss_diff(name: str) -> str:
    """What the loss pass changes in the captured graph (tests/frontend/test_capture.py)."""
    model, example = make_model(name, n_layer=1), make_batch(2, seed=0)
    return graph_diff(capture(model, example).gm.code, graph_after(model, example, "loss").code)


class LossGraphs(TestCase):
    def test_gpt(self):
        self.assertExpectedInline(
            _loss_diff("gpt"),
            """\
@@
-    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1);  flatten = flatten_1 = None
-    return (cross_entropy_loss,)
+    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1, None, 2, -100, 0.0);  flatten = None
+    ne_scalar = torch.ops.aten.ne.Scalar(flatten_1, -100);  flatten_1 = None
+    num_tokens = torch.ops.aten.sum.default(ne_scalar);  ne_scalar = None
+    return (cross_entropy_loss, num_tokens)""",  # noqa: E501 (expected text, compared whole)
        )

    def test_llama(self):
        self.assertExpectedInline(
            _loss_diff("llama"),
            """\
@@
-    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1);  flatten = flatten_1 = None
-    return (cross_entropy_loss,)
+    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1, None, 2, -100, 0.0);  flatten = None
+    ne_scalar = torch.ops.aten.ne.Scalar(flatten_1, -100);  flatten_1 = None
+    num_tokens = torch.ops.aten.sum.default(ne_scalar);  ne_scalar = None
+    return (cross_entropy_loss, num_tokens)""",  # noqa: E501 (expected text, compared whole)
        )


class _Head(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.proj = torch.nn.Linear(8, 10)
        self.fn = fn

    def forward(self, x, y):
        return self.fn(self.proj(x), y)


def _masked(logits, y):
    per_token = F.cross_entropy(logits, y.clamp(min=0), reduction="none")
    mask = (y >= 0).float()
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


LOSSES = {
    "cross_entropy": lambda z, y: F.cross_entropy(z, y),
    "nll": lambda z, y: F.nll_loss(F.log_softmax(z, -1), y),
    "masked_mean": _masked,
    "plain_mean": lambda z, y: (z**2).mean(),
    "tuple_output": lambda z, y: (F.cross_entropy(z, y), z),
    "cast_of_mean": lambda z, y: F.cross_entropy(z, y).double(),
}


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_sum_and_count_equal_mean_times_count(kind):
    torch.manual_seed(0)
    model = _Head(LOSSES[kind])
    x = torch.randn(6, 8)
    y = torch.tensor([1, -100, 3, 2, -100, 9])
    gm = loss(capture(model, (x, y)).gm)
    loss_sum, num_tokens = gm(x, y)
    mean = model(x, y)
    mean = mean[0] if isinstance(mean, tuple) else mean
    count = 60 if kind == "plain_mean" else 4  # every logit, or the non-ignored labels
    torch.testing.assert_close(loss_sum.double(), mean.double() * count, rtol=1e-6, atol=0)
    assert int(num_tokens) == count


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_reference_models_sum_and_count(name):
    model = make_model(name)
    ids, labels = make_batch(2, seed=3)
    gm = loss(capture(model, (ids, labels)).gm)
    loss_sum, num_tokens = gm(ids, labels)
    count = int((labels != -100).sum())
    assert int(num_tokens) == count
    torch.testing.assert_close(loss_sum, model(ids, labels) * count, rtol=1e-6, atol=0)


def test_explicit_loss_fn_is_kept():
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 10)

        def forward(self, x):
            return self.proj(x)

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y, reduction="sum", ignore_index=-1), (y != -1).sum()

    model = Logits()
    x, y = torch.randn(4, 8), torch.tensor([1, -1, 3, 2])
    c = capture(model, (x, y), loss_fn=loss_fn)
    gm = loss(c.gm)
    loss_sum, num_tokens = gm(x, y)
    assert int(num_tokens) == 3
    torch.testing.assert_close(loss_sum, F.cross_entropy(model(x), y, ignore_index=-1) * 3)
    assert gm.get_parameter("proj.weight") is model.proj.weight  # user names, no prefix


def test_unrecognised_loss_says_how_to_pass_loss_fn():
    model = _Head(lambda z, y: F.cross_entropy(z, y) ** 2)
    with pytest.raises(PassError) as err:
        loss(capture(model, (torch.randn(4, 8), torch.tensor([1, 2, 3, 4]))).gm)
    msg = str(err.value)
    assert "cannot recognise the loss" in msg and "aten::pow" in msg and "loss_fn=" in msg


def test_non_scalar_output_is_refused():
    model = _Head(lambda z, y: z)
    with pytest.raises(PassError, match=r"shape \[4, 10\], not a scalar loss"):
        loss(capture(model, (torch.randn(4, 8), torch.tensor([1, 2, 3, 4]))).gm)


def test_class_weights_are_refused():
    w = torch.ones(10)
    model = _Head(lambda z, y: F.cross_entropy(z, y, weight=w))
    with pytest.raises(PassError, match="class weights"):
        loss(capture(model, (torch.randn(4, 8), torch.tensor([1, 2, 3, 4]))).gm)


def test_explicit_loss_fn_must_return_two_scalars():
    model = _Head(lambda z, y: z)
    c = capture(model, (torch.randn(4, 8), torch.tensor([1, 2, 3, 4])),
                loss_fn=lambda m, x, y: (m(x, y).sum(),))
    with pytest.raises(PassError, match=r"loss_fn must return \(loss_sum, num_tokens\)"):
        loss(c.gm)
