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
from fxmeg.program import split_spec
from fxmeg.transform import transform
from tests.helpers import make_batch, make_model
from tests.passes.test_tp_dropout import Block

MBS = 2


def _program(model, **options):
    ids, labels = make_batch(MBS, seed=0, vocab=options.pop("vocab", 128))
    return transform(model, (ids, labels), pp=2, schedule="zbh1", global_batch_size=2 * MBS, **options), (ids, labels)


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
    program, _ = _program(_Tiny(), vocab=16)
    gm = program.chunks[1]
    assert split_spec(gm).weights == ("layers.1.weight", "head.weight")
    assert_expected_inline(gm.zb_weight.code.strip(), """""")
    assert_expected_inline(gm.zb_input.code.strip(), """""")


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
