"""The pipeline pass: chunk graphs with explicit recv / send / deallocate nodes."""

import pytest
import torch
from expecttest import TestCase

from fxmeg.ir.program import chunk_spec, chunks
from tests.harness.helpers import chunk_boundaries, graph_after, make_batch
from tests.harness.models import make_model


def _pipelined(name, *, n_layer, num_chunks):
    model = make_model(name, n_layer=n_layer)
    return model, graph_after(model, make_batch(2, seed=0), "pipeline", num_chunks=num_chunks)


class ChunkBoundaries(TestCase):
    """What the split decides, per chunk: signature, recv / send / deallocate nodes and
    return. The bodies are the graph the pass receives (see test_loss.py), cut at the
    boundaries; test_chained_chunks_compute_the_captured_loss checks them numerically."""

    def test_gpt_pp2(self):
        parent = _pipelined("gpt", n_layer=2, num_chunks=2)[1]
        self.assertExpectedInline(
            chunk_boundaries(parent),
            """\
# chunk 0
def forward(self, input_ids):
    send_add_2 = fxmeg_ir_ops_send(add_2, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_2 = None
    deallocate_add_2 = fxmeg_ir_ops_deallocate(send_add_2);  deallocate_add_2 = None
    return (send_add_2,)

# chunk 1
def forward(self, labels, add_2):
    recv_add_2 = fxmeg_ir_ops_recv(add_2, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_2 = None
    return (cross_entropy_loss, num_tokens)""",  # noqa: E501 (expected text, compared whole)
        )

    def test_llama_pp2(self):
        parent = _pipelined("llama", n_layer=2, num_chunks=2)[1]
        self.assertExpectedInline(
            chunk_boundaries(parent),
            """\
# chunk 0
def forward(self, input_ids):
    send_slice_1 = fxmeg_ir_ops_send(slice_1, dst_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    send_slice_2 = fxmeg_ir_ops_send(slice_2, dst_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    send_add_5 = fxmeg_ir_ops_send(add_5, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_5 = None
    deallocate_add_5 = fxmeg_ir_ops_deallocate(send_add_5);  deallocate_add_5 = None
    return (send_slice_1, send_slice_2, send_add_5)

# chunk 1
def forward(self, labels, slice_1, slice_2, add_5):
    recv_slice_1 = fxmeg_ir_ops_recv(slice_1, src_chunk = 0, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    recv_slice_2 = fxmeg_ir_ops_recv(slice_2, src_chunk = 0, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    recv_add_5 = fxmeg_ir_ops_recv(add_5, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_5 = None
    return (cross_entropy_loss, num_tokens)""",  # noqa: E501 (expected text, compared whole)
        )

    def test_gpt_pp2_vpp2(self):
        parent = _pipelined("gpt", n_layer=4, num_chunks=4)[1]
        self.assertExpectedInline(
            chunk_boundaries(parent),
            """\
# chunk 0
def forward(self, input_ids):
    send_add_2 = fxmeg_ir_ops_send(add_2, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_2 = None
    deallocate_add_2 = fxmeg_ir_ops_deallocate(send_add_2);  deallocate_add_2 = None
    return (send_add_2,)

# chunk 1
def forward(self, add_2):
    recv_add_2 = fxmeg_ir_ops_recv(add_2, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_2 = None
    send_add_4 = fxmeg_ir_ops_send(add_4, dst_chunk = 2, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_4 = None
    deallocate_add_4 = fxmeg_ir_ops_deallocate(send_add_4);  deallocate_add_4 = None
    return (send_add_4,)

# chunk 2
def forward(self, add_4):
    recv_add_4 = fxmeg_ir_ops_recv(add_4, src_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_4 = None
    send_add_6 = fxmeg_ir_ops_send(add_6, dst_chunk = 3, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_6 = None
    deallocate_add_6 = fxmeg_ir_ops_deallocate(send_add_6);  deallocate_add_6 = None
    return (send_add_6,)

# chunk 3
def forward(self, labels, add_6):
    recv_add_6 = fxmeg_ir_ops_recv(add_6, src_chunk = 2, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_6 = None
    return (cross_entropy_loss, num_tokens)""",  # noqa: E501 (expected text, compared whole)
        )

    def test_llama_pp2_vpp2(self):
        parent = _pipelined("llama", n_layer=4, num_chunks=4)[1]
        self.assertExpectedInline(
            chunk_boundaries(parent),
            """\
# chunk 0
def forward(self, input_ids):
    send_slice_1 = fxmeg_ir_ops_send(slice_1, dst_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    send_slice_2 = fxmeg_ir_ops_send(slice_2, dst_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    send_add_5 = fxmeg_ir_ops_send(add_5, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_5 = None
    deallocate_add_5 = fxmeg_ir_ops_deallocate(send_add_5);  deallocate_add_5 = None
    return (send_slice_1, send_slice_2, send_add_5)

# chunk 1
def forward(self, slice_1, slice_2, add_5):
    recv_slice_1 = fxmeg_ir_ops_recv(slice_1, src_chunk = 0, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    recv_slice_2 = fxmeg_ir_ops_recv(slice_2, src_chunk = 0, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    recv_add_5 = fxmeg_ir_ops_recv(add_5, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_5 = None
    send_slice_1 = fxmeg_ir_ops_send(recv_slice_1, dst_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False);  recv_slice_1 = None
    send_slice_2 = fxmeg_ir_ops_send(recv_slice_2, dst_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False);  recv_slice_2 = None
    send_add_11 = fxmeg_ir_ops_send(add_11, dst_chunk = 2, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_11 = None
    deallocate_add_11 = fxmeg_ir_ops_deallocate(send_add_11);  deallocate_add_11 = None
    return (send_slice_1, send_slice_2, send_add_11)

# chunk 2
def forward(self, slice_1, slice_2, add_11):
    recv_slice_1 = fxmeg_ir_ops_recv(slice_1, src_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    recv_slice_2 = fxmeg_ir_ops_recv(slice_2, src_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    recv_add_11 = fxmeg_ir_ops_recv(add_11, src_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_11 = None
    send_slice_1 = fxmeg_ir_ops_send(recv_slice_1, dst_chunk = 3, shape = [16, 8], dtype = torch.float32, grad = False);  recv_slice_1 = None
    send_slice_2 = fxmeg_ir_ops_send(recv_slice_2, dst_chunk = 3, shape = [16, 8], dtype = torch.float32, grad = False);  recv_slice_2 = None
    send_add_17 = fxmeg_ir_ops_send(add_17, dst_chunk = 3, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_17 = None
    deallocate_add_17 = fxmeg_ir_ops_deallocate(send_add_17);  deallocate_add_17 = None
    return (send_slice_1, send_slice_2, send_add_17)

# chunk 3
def forward(self, labels, slice_1, slice_2, add_17):
    recv_slice_1 = fxmeg_ir_ops_recv(slice_1, src_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    recv_slice_2 = fxmeg_ir_ops_recv(slice_2, src_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    recv_add_17 = fxmeg_ir_ops_recv(add_17, src_chunk = 2, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_17 = None
    return (cross_entropy_loss, num_tokens)""",  # noqa: E501 (expected text, compared whole)
        )


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_chained_chunks_compute_the_captured_loss(name, k):
    model, parent = _pipelined(name, n_layer=4, num_chunks=k)
    ids, labels = make_batch(2, seed=7)
    loss_sum, num_tokens = parent(ids, labels)
    assert int(num_tokens) == int((labels != -100).sum())
    assert torch.equal(loss_sum / num_tokens, model(ids, labels))


def test_boundaries_carry_several_tensors_and_relay_them():
    _, parent = _pipelined("llama", n_layer=4, num_chunks=4)
    specs = [chunk_spec(gm) for gm in chunks(parent)]
    assert [s.data_inputs for s in specs] == [(0,), (), (), (1,)]  # ids first, labels last
    for s in specs[:-1]:  # rotary tables (no grad) ride along with the hidden state
        assert [(b.name, b.grad) for b in s.send][:2] == [("slice_1", False), ("slice_2", False)]
        assert s.send[2].grad and s.send[2].shape == (2, 16, 32)
        assert s.deallocate == (False, False, True)  # relayed / no-grad tensors stay
    for prev, nxt in zip(specs, specs[1:]):
        assert nxt.recv == prev.send
    assert specs[-1].is_last and not any(s.is_last for s in specs[:-1])
    middle = chunks(parent)[1].code
    assert (
        "send_slice_1 = fxmeg_ir_ops_send(recv_slice_1, dst_chunk = 2, shape = [16, 8], dtype = "
        "torch.float32, grad = False)" in middle
    )


def test_tied_weight_is_held_by_both_ends():
    _, parent = _pipelined("gpt", n_layer=4, num_chunks=4)
    holders = [
        c for c, gm in enumerate(chunks(parent)) if "wte.weight" in dict(gm.named_parameters())
    ]
    assert holders == [0, 3]
    first, last = chunks(parent)[0], chunks(parent)[3]
    assert first.get_parameter("wte.weight") is last.get_parameter("wte.weight")
