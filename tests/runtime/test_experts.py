"""The expert all-to-all exchange (fxmeg/runtime/experts.py) on 2 real gloo ranks: rows
reach the rank holding their expert and come back, gradients the reverse way, and a
traced step records each all-to-all as an ``ep_a2a`` span (nothing when tracing is off)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fxmeg.ir import moe
from fxmeg.runtime import experts
from fxmeg.runtime.timelines import Tracer
from tests.harness.distributed import run_world
from tests.harness.models import make_model

E = 4  # experts, 2 per rank


def exchange_rows(rank: int) -> dict:
    group = dist.new_group([0, 1])
    ex = experts.RankExperts(tracer=Tracer()).exchange(group.group_name)
    out = {}
    for traced in (False, True):
        ex.tracer.begin_step(traced)
        # rows per expert
        counts = torch.tensor([1, 2, 0, 3]) if rank == 0 else torch.tensor([2, 0, 1, 1])
        rows = (
            (torch.arange(int(counts.sum()), dtype=torch.float32) + 10 * rank)
            .unsqueeze(1)
            .requires_grad_()
        )
        got, per_expert, state = ex.dispatch(rows, counts)
        back = ex.combine(got * 2, state)
        back.sum().backward()
        out[traced] = dict(got=got.detach().flatten().tolist(), per_expert=per_expert.tolist(),
                           back=back.detach().flatten().tolist(), grad=rows.grad.flatten().tolist(),
                           spans=[(name, cat) for name, cat, _, _ in ex.tracer.events or []])
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(2, exchange_rows)


def test_rows_go_to_their_expert_and_back(ranks):
    r0, r1 = ranks[0][True], ranks[1][True]
    # rank 0 holds experts 0, 1: rank 0's rows 0 (e0), 1-2 (e1); rank 1's rows 10-11 (e0)
    assert r0["got"] == [0.0, 10.0, 11.0, 1.0, 2.0] and r0["per_expert"] == [3, 2]
    # rank 1 holds experts 2, 3: rank 0's rows 3-5 (e3); rank 1's rows 12 (e2), 13 (e3)
    assert r1["got"] == [12.0, 3.0, 4.0, 5.0, 13.0] and r1["per_expert"] == [1, 4]
    for r, rank in ((r0, 0), (r1, 1)):
        n = len(r["back"])
        # each row back where it came from
        assert r["back"] == [2 * (i + 10 * rank) for i in range(n)]
        assert r["grad"] == [2.0] * n


def test_each_all_to_all_is_a_span_when_traced(ranks):
    for r in ranks:
        assert r[False]["spans"] == []
        names = [name for name, cat in r[True]["spans"] if cat == "ep_a2a"]
        assert sorted(names) == [
            "ep combine",
            "ep combine grad",
            "ep counts",
            "ep dispatch",
            "ep dispatch grad",
        ]


@pytest.mark.parametrize("kernel", [False, True], ids=["loop", "grouped-kernel"])
def test_routed_experts_are_hugging_faces_bit_for_bit_in_bf16(kernel, monkeypatch):
    """In process, no ranks: ``fxmeg.ir.moe.routed_experts`` (every expert local) gives
    Mixtral's bf16 grouped experts' output and gradients exactly, with its expert matmuls
    one per expert (CPU's way) or one ``torch._grouped_mm`` each (CUDA's, forced here); its
    router's top-k weights are fp32, so the weighted rows and their sum over the k slots are
    fp32 there (rounding them to bf16 first moved the output by 3e-3 and every gradient by
    2e-3 to 5e-3, relative)."""
    monkeypatch.setattr(moe, "GROUPED_KERNEL_DEVICES", ("cpu",) if kernel else ())
    calls = []
    monkeypatch.setattr(torch.ops.aten, "_grouped_mm", _recorded(torch.ops.aten._grouped_mm, calls))
    experts = make_model("moe-mixtral", n_layer=1).to(torch.bfloat16).model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=g).to(torch.bfloat16).requires_grad_(True)
    weights, index = torch.randn(64, 4, generator=g).softmax(-1).topk(2, -1)
    weights = (weights / weights.sum(-1, keepdim=True)).requires_grad_(True)
    probe = torch.randn(64, 32, generator=g)

    def grads(fn) -> list[torch.Tensor]:
        out = fn()
        inputs = [hidden, weights, experts.gate_up_proj, experts.down_proj]
        return [out.detach(), *torch.autograd.grad((out.float() * probe).sum(), inputs)]

    want = grads(lambda: experts(hidden, index, weights))
    got = grads(lambda: moe.routed_experts(experts._apply_gate, hidden, index, weights,
                                           experts.gate_up_proj.transpose(-2, -1),
                                           experts.down_proj.transpose(-2, -1), num_experts=4))
    for name, a, b in zip(["output", "hidden", "weights", "gate_up_proj", "down_proj"], want, got):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert len(calls) == (2 if kernel else 0)  # fxmeg's up and down matmuls


def _recorded(fn, calls: list):
    def recorded(*args, **kwargs):
        calls.append(args[2])
        return fn(*args, **kwargs)

    return recorded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "column-major"])
def test_the_grouped_kernel_gives_the_loops_values_and_gradients(dtype, transposed):
    """``moe.grouped_mm``'s two ways, one ``torch._grouped_mm`` (CUDA's) and one matmul per
    expert (CPU's), agree bit for bit on the result and both gradients, with experts without
    rows (their bank gradient zero) and a bank stored transposed; the kernel is not chosen
    where a row would start off a 16-byte boundary."""
    g = torch.Generator().manual_seed(0)
    sizes = [5, 0, 11, 0]
    x = torch.randn(16, 32, generator=g).to(dtype).requires_grad_(True)
    bank = torch.randn(4, 48, 32, generator=g).to(dtype).requires_grad_(True)
    w = bank.transpose(-2, -1) if transposed else bank.view(4, 32, 48)
    probe = torch.randn(16, 48, generator=g).to(dtype)
    assert moe.grouped_kernel(x, w)
    got = {}
    for kernel in (False, True):
        out = moe.grouped_mm(x, w, sizes, kernel=kernel)
        got[kernel] = [out, *torch.autograd.grad((out * probe).sum(), [x, bank])]
    for name, a, b in zip(["output", "rows", "bank"], got[False], got[True]):
        assert torch.equal(a, b), name
    assert not got[True][2][[1, 3]].any()
    assert not moe.grouped_kernel(x[:, :6], w[:, :6])  # rows of 6 elements: off the boundary
    assert not moe.grouped_kernel(x.double(), w)  # dtypes differ


def test_experts_without_rows_keep_their_rows_in_backward():
    """In process: a rank whose experts receive no rows (AFMoE's zero-initialised router
    sends every token to another rank's experts) still has a gradient path from the
    experts' output to those (empty) rows, so backward runs the dispatch's all-to-all there
    as on its peers (without it the peers wait for gradients this rank never sends, and
    gloo aborts); the banks get a zero gradient."""
    rows = torch.zeros(0, 32, requires_grad=True)
    w_up, w_down = (
        torch.randn(2, 32, 96, requires_grad=True),
        torch.randn(2, 48, 32, requires_grad=True),
    )
    middle = make_model("moe-mixtral", n_layer=1).model.layers[0].mlp.experts._apply_gate
    out = moe.expert_mlp(middle, rows, [0, 0], w_up, w_down, None, None)
    d_rows, d_up, d_down = torch.autograd.grad(out.sum(), [rows, w_up, w_down])
    assert out.shape == (0, 32) and d_rows.shape == (0, 32)
    assert not d_up.any() and not d_down.any()
