"""The split_backward pass (zero-bubble schedules): each chunk's backward as an
input-gradient graph I and a weight-gradient graph W, derived from its AOT joint graph.
I then W give exactly the gradients of the chunk's autograd backward; W reads only what
I hands it; recompute regions are recomputed, not saved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

from fxmeg.errors import PassError
from fxmeg.frontend.pass_driver import transform
from fxmeg.ir.program import split_spec
from tests.harness.helpers import make_batch
from tests.harness.models import make_model
from tests.passes.test_tp_dropout import Block

MBS = 2


def _program(model, **options):
    ids, labels = make_batch(MBS, seed=0, vocab=options.pop("vocab", 128))
    return transform(
        model, (ids, labels), pp=2, schedule="zbh1", global_batch_size=2 * MBS, **options
    ), (ids, labels)


def _autograd(program, batch):
    """Both chunks under autograd: (loss, every parameter's gradient)."""
    for gm in program.chunks:
        for p in gm.parameters():
            p.grad = None
    first, last = program.specs
    outs = program.chunks[0](*[batch[i] for i in first.data_inputs])
    recv = [o.detach().requires_grad_(b.grad) for o, b in zip(outs, last.recv)]
    loss = program.chunks[1](*[batch[i] for i in last.data_inputs], *recv)[-2]
    loss.backward()
    torch.autograd.backward([o for o, b in zip(outs, first.send) if b.grad],
                            [r.grad for r, b in zip(recv, last.recv) if b.grad])
    return loss, {n: p.grad.clone() for gm in program.chunks for n, p in gm.named_parameters()}


def _split(program, batch):
    """Both chunks through zb_forward, then zb_input and zb_weight: (loss, gradients, the
    number of tensors each chunk's forward saved)."""
    saved, outputs = [], []
    for c, gm in enumerate(program.chunks):
        spec, state = split_spec(gm), dict(gm.named_parameters()) | dict(gm.named_buffers())
        received = list(outputs[-1][: len(program.specs[c].recv)]) if c else []
        with torch.no_grad():
            outs = gm.zb_forward(*[state[n].detach() for n in spec.state],
                                 *[batch[i] for i in program.specs[c].data_inputs], *received)
        outputs.append(outs[: spec.outputs])
        saved.append(outs[spec.outputs:])
    grads: dict[str, torch.Tensor] = {}
    upstream = [torch.ones(())]
    for c in (1, 0):
        gm, spec = program.chunks[c], split_spec(program.chunks[c])
        wanted = sum(b.grad for b in program.specs[c].recv)
        with torch.no_grad():
            out = gm.zb_input(*saved[c], *upstream)
            upstream, carry = list(out[:wanted]), out[wanted:]
            for name, g in zip(spec.weights, gm.zb_weight(*carry)):
                grads[name] = grads[name] + g if name in grads else g
    return outputs[1][-2], grads, [len(s) for s in saved]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_input_then_weight_gradients_are_autograd_s(name, recompute):
    program, batch = _program(make_model(name), recompute=recompute)
    loss, want = _autograd(program, batch)
    got_loss, got, _ = _split(program, batch)
    assert torch.equal(got_loss, loss.detach())
    assert got.keys() == want.keys()
    for n, w in want.items():
        if name == "gpt":  # the same ATen kernels in the same order
            assert torch.equal(got[n], w), n
        else:  # repeat_interleave and rms-norm backward decompose into other kernels
            torch.testing.assert_close(got[n], w, rtol=1e-5, atol=1e-6, msg=n)


def test_recompute_regions_are_recomputed_not_saved():
    model = make_model("gpt")
    kept = {mode: _split(*_program(model, recompute=mode))[2] for mode in ("none", "full")}
    assert all(f < n for f, n in zip(kept["full"], kept["none"])), kept


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])
        self.head = nn.Linear(4, 16, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_last_chunk_split_snapshot():
    """I: the gradient of the received hidden state (and what W needs); W: the two weight
    gradients, from I's carried values only."""
    torch.manual_seed(0)
    program, _ = _program(_Tiny(), vocab=16, split_points=["layers.1"])
    gm = program.chunks[1]
    assert sorted(split_spec(gm).weights) == ["head.weight", "layers.1.weight"]
    assert_expected_inline(gm.zb_weight.code.strip(), """\
def forward(self, view, view_1, view_5, view_7):
    t_2 = torch.ops.aten.t.default(view_5);  view_5 = None
    mm_2 = torch.ops.aten.mm.default(t_2, view_1);  t_2 = view_1 = None
    t_3 = torch.ops.aten.t.default(mm_2);  mm_2 = None
    t_5 = torch.ops.aten.t.default(t_3);  t_3 = None
    t_6 = torch.ops.aten.t.default(view_7);  view_7 = None
    mm_4 = torch.ops.aten.mm.default(t_6, view);  t_6 = view = None
    t_7 = torch.ops.aten.t.default(mm_4);  mm_4 = None
    t_9 = torch.ops.aten.t.default(t_7);  t_7 = None
    return (t_5, t_9)""")
    assert_expected_inline(
        gm.zb_input.code.strip(),
        """\
def forward(self, t, view, detach, t_1, view_1, view_3, _log_softmax, detach_1, getitem_1, tangents_1):
    nll_loss_backward = torch.ops.aten.nll_loss_backward.default(tangents_1, _log_softmax, view_3, None, 2, -100, getitem_1);  tangents_1 = _log_softmax = view_3 = getitem_1 = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    _log_softmax_backward_data = torch.ops.aten._log_softmax_backward_data.default(nll_loss_backward, detach_2, 1, torch.float32);  nll_loss_backward = detach_2 = None
    view_4 = torch.ops.aten.view.default(_log_softmax_backward_data, [2, 16, 16]);  _log_softmax_backward_data = None
    view_5 = torch.ops.aten.view.default(view_4, [32, 16]);  view_4 = None
    t_4 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm_3 = torch.ops.aten.mm.default(view_5, t_4);  t_4 = None
    view_6 = torch.ops.aten.view.default(mm_3, [2, 16, 4]);  mm_3 = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    tanh_backward = torch.ops.aten.tanh_backward.default(view_6, detach_3);  detach_3 = None
    view_7 = torch.ops.aten.view.default(tanh_backward, [32, 4]);  tanh_backward = None
    t_8 = torch.ops.aten.t.default(t);  t = None
    mm_5 = torch.ops.aten.mm.default(view_7, t_8);  t_8 = None
    view_8 = torch.ops.aten.view.default(mm_5, [2, 16, 4]);  mm_5 = None
    add_1 = torch.ops.aten.add.Tensor(view_6, view_8);  view_6 = view_8 = None
    return (add_1, view, view_1, view_5, view_7)""",  # noqa: E501 (expected text, compared whole)
    )


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(128, 16), nn.Linear(16, 128)
        self.layers = nn.ModuleList([Block(fused=False, p=0.5) for _ in range(2)])

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_dropout_under_tensor_parallelism_is_refused():
    """Its per-tp-rank random stream is switched by markers the joint graph cannot keep."""
    with pytest.raises(PassError, match="draws random numbers per tensor-parallel rank"):
        _program(_Dropout(), tp=2)


class _LinearBlocks(nn.Module):
    """Blocks that are a bare ``nn.Linear``: a chunk ends in a linear map of a 3-D tensor,
    which AOT autograd computes as a 2-D product viewed back (an aliasing output)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(128, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 128, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_a_chunk_ending_in_a_linear_map_splits():
    """Its output is copied before the split (the joint export refuses an alias), and I then
    W still give autograd's gradients."""
    program, batch = _program(_LinearBlocks())
    loss, want = _autograd(program, batch)
    got_loss, got, _ = _split(program, batch)
    assert torch.equal(got_loss, loss.detach()) and got.keys() == want.keys()
    for n, w in want.items():
        assert torch.equal(got[n], w), n


_SPLIT_GRAPHS = """
from tests.passes.test_split_backward import _program
from tests.harness.models import make_model
program, _ = _program(make_model("gpt"), tp=2, sequence_parallel=True, recompute="full")
for gm in program.chunks:
    for name in ("zb_forward", "zb_input", "zb_weight"):
        print(name, [str(n.target) for n in getattr(gm, name).graph.nodes])
import sys
print("inductor imported:", "torch._inductor.lowering" in sys.modules)
"""


def test_the_split_is_the_same_in_every_process():
    """Every rank of a tp group must run the same collectives in the same order. Under
    recompute the min-cut partitioner decides what backward makes again, and it read each
    region's id, once a string's hash: another PYTHONHASHSEED, another cut (the
    tp2 sp x pp2 zbh1 full-recompute GPT hung on 8 ranks, its tp pair in different
    collectives). Two processes with different seeds now split alike. And the split
    leaves torch's compiler stack unimported: the partitioner's own CSE pass imports
    inductor's lowerings (about 21 MiB resident on every rank, torch_private)."""
    import os
    import subprocess
    import sys

    def graphs(seed: str) -> str:
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, "-c", _SPLIT_GRAPHS], env=env, check=True,
                              capture_output=True, text=True).stdout
    first = graphs("1")
    assert "sp_gather" in first and first == graphs("2")
    assert "inductor imported: False" in first
