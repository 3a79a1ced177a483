"""One packed message per cut: a layout over mixed dtypes keeps every piece aligned,
packing then unpacking gives back the tensors bit for bit as views of the buffer, and
the views serve as autograd leaves whose gradients pack the same way."""

import pytest
import torch

from fxmeg.ir.program import Boundary
from fxmeg.runtime.pipeline.packing import ALIGN, Layout


def _boundary(shape, dtype, grad=False) -> Boundary:
    return Boundary(name=f"t{len(shape)}_{dtype}", shape=shape, dtype=dtype, grad=grad, src=0)


CUT = (  # a Llama-like cut: odd sizes between the pieces so that padding is needed
    _boundary((3, 5, 7), torch.float32, grad=True),  # hidden state, 420 bytes
    _boundary((3, 1, 5, 5), torch.bool),  # attention mask, 75 bytes
    _boundary((5, 3), torch.bfloat16),  # rotary table, 30 bytes
    _boundary((), torch.int64),  # a scalar
    _boundary((2, 3), torch.float64, grad=True),
    _boundary((0, 4), torch.float16),  # empty
)


def _values(cut) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for b in cut:
        x = torch.randn(b.shape, generator=g, dtype=torch.float64)
        out.append(x > 0 if b.dtype is torch.bool else (x * 100).to(b.dtype))
    return out


def test_layout_aligns_every_piece_and_packs_them_in_order():
    layout = Layout.of(CUT)
    offsets = [p.offset for p in layout.pieces]
    assert offsets == [0, 432, 512, 544, 560, 608]
    assert all(o % ALIGN == 0 for o in offsets) and layout.nbytes % ALIGN == 0
    ends = [p.offset + p.nbytes for p in layout.pieces]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:]))  # no overlap
    assert layout.nbytes == 608 and Layout.of(()).nbytes == 0


def test_round_trip_is_bitwise_and_unpacked_tensors_view_the_buffer():
    layout = Layout.of(CUT)
    values = _values(CUT)
    values[0] = values[0].transpose(0, 2).contiguous().transpose(0, 2)  # non-contiguous input
    buf = layout.pack(values)
    assert buf.dtype == torch.uint8 and buf.shape == (layout.nbytes,)
    got = layout.unpack(buf)
    for g, v, b in zip(got, values, CUT):
        assert g.dtype == b.dtype and g.shape == b.shape and g.is_contiguous()
        assert torch.equal(g, v)
        assert g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    buf.zero_()  # the views see the buffer, no copy
    assert not got[0].any() and not got[1].any()


def test_unpacked_views_are_leaves_that_receive_gradients():
    """What the executor does with a received cut: requires_grad_ on the pieces that
    carry a gradient, run, backward; each piece's .grad is what goes back, packed."""
    layout = Layout.of(CUT)
    source = _values(CUT)
    received = layout.unpack(layout.pack(source))
    for t, b in zip(received, CUT):
        t.requires_grad_(b.grad)
    hidden, mask, rope, _, extra, _ = received
    assert hidden.is_leaf and hidden.grad_fn is None and hidden.requires_grad
    out = (hidden * mask.float().sum() + rope.float().sum()).pow(2).sum() + extra.sum() * 3
    out.backward()
    want = (
        2
        * (source[0] * source[1].float().sum() + source[2].float().sum())
        * source[1].float().sum()
    )
    torch.testing.assert_close(hidden.grad, want)
    assert torch.equal(extra.grad, torch.full((2, 3), 3.0, dtype=torch.float64))
    assert mask.grad is None and rope.grad is None
    grads = Layout.of([b for b in CUT if b.grad])
    back = grads.unpack(grads.pack([hidden.grad, extra.grad]))
    assert torch.equal(back[0], hidden.grad) and torch.equal(back[1], extra.grad)


def test_packing_tensors_that_require_grad_records_no_autograd_history():
    cut = CUT[:1]
    x = torch.randn(cut[0].shape, requires_grad=True)
    buf = Layout.of(cut).pack([x * 2])
    assert not buf.requires_grad and buf.grad_fn is None


def test_unpack_refuses_a_buffer_of_the_wrong_size():
    with pytest.raises(AssertionError):
        Layout.of(CUT).unpack(torch.empty(16, dtype=torch.uint8))
