"""The rule of rounding (tests.harness.judge) judged by itself: correct runs in other
summation orders, under other CPU kernels, pass; planted wrong gradients of each size and
kind fail; a replica that differs between ranks is named."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.harness import judge
from tests.harness.helpers import (
    assert_grads_close,
    digests,
    make_batch,
    optimizer,
    reference_groups,
    reference_run,
    replica_failures,
)
from tests.harness.models import make_model

STEPS = 3
SMALL = "layers.0.input_layernorm.weight"
"""A small parameter (32 elements) of the tiny Llama."""


def batches():
    return [make_batch(8, seed=10 + s) for s in range(STEPS)]


def accumulated(model: torch.nn.Module, data, micro_batch_size: int = 2) -> list[dict]:
    """Another correct training, in plain PyTorch: the global batch's mean loss as the sum
    of each micro-batch's loss sum over the global token count (fxmeg's order), the parity
    AdamW, clipping at 1. Returns each step's gradients."""
    model = copy.deepcopy(model)
    opt = optimizer(reference_groups(model.named_parameters()))
    out = []
    for ids, labels in data:
        opt.zero_grad()
        total = int((labels != -100).sum())
        for lo in range(0, len(ids), micro_batch_size):
            part = slice(lo, lo + micro_batch_size)
            n = int((labels[part] != -100).sum())
            (model(ids[part], labels[part]) * n / total).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return out


@pytest.fixture(scope="module")
def ref():
    return reference_run(make_model("llama"), batches())


@pytest.fixture(scope="module")
def correct():
    return accumulated(make_model("llama"), batches())


def planted(grads: list[dict], step: int, name: str, change) -> list[dict]:
    out = [dict(g) for g in grads]
    out[step][name] = change(out[step][name].clone())
    return out


@pytest.fixture(autouse=True)
def judged(monkeypatch):
    """Every gradient goes to the judge (none passes for being near the reference's)."""
    monkeypatch.setattr(judge, "GRAD_RTOL", 0.0)


def test_a_correct_run_in_another_order_passes(ref, correct):
    assert_grads_close(correct, ref)


CHILD = textwrap.dedent("""
    import sys, torch
    from tests.harness.models import make_model
    from tests.harness.test_judge import accumulated, batches
    assert torch.backends.cpu.get_cpu_capability() == sys.argv[2], (
        torch.backends.cpu.get_cpu_capability())
    torch.save(accumulated(make_model("llama"), batches()), sys.argv[1])
""")


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2"])
def test_correct_runs_under_other_kernels_pass(ref, tmp_path, capability):
    """The same correct run in a child on other CPU kernels (ATen's vectorised code, MKL's
    and oneDNN's instruction sets, as another machine dispatches them)."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower(), OMP_NUM_THREADS="1")
    if capability == "AVX2":
        env |= dict(MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
    path = tmp_path / "grads.pt"
    subprocess.run([sys.executable, "-c", CHILD, str(path), capability], env=env, check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert_grads_close(torch.load(path), ref)


@pytest.mark.parametrize("step", range(STEPS))
def test_a_small_relative_error_on_a_small_parameter_fails(ref, correct, step):
    wrong = planted(correct, step, SMALL, lambda g: g + 1e-3 * g.norm() * torch.randn(
        g.shape, generator=torch.Generator().manual_seed(0)) / g.numel() ** 0.5)
    with pytest.raises(AssertionError, match=f"step {step}: gradient of {SMALL} off by"):
        assert_grads_close(wrong, ref)


@pytest.mark.parametrize("kind", ["zero", "inf", "nan", "halved"])
def test_wrong_gradients_fail(ref, correct, kind):
    change = {
        "zero": torch.zeros_like,
        "inf": lambda g: g.index_fill(0, torch.tensor([3]), float("inf")),
        "nan": lambda g: g.index_fill(0, torch.tensor([3]), float("nan")),
        "halved": lambda g: g / 2,
    }[kind]
    name = "layers.1.self_attn.q_proj.weight" if kind == "halved" else SMALL
    with pytest.raises(AssertionError, match=f"gradient of {name}"):
        assert_grads_close(planted(correct, 1, name, change), ref)


def test_a_skipped_step_must_overflow_too(ref, correct):
    """Where the reference overflowed (fp16, a skipped step), finite gradients fail."""
    overflowed = copy.copy(ref)
    grads = [dict(g) for g in ref.grads]
    grads[1][SMALL] = torch.full_like(grads[1][SMALL], float("inf"))
    object.__setattr__(overflowed, "grads", grads)
    with pytest.raises(AssertionError, match="step 1: the reference overflowed"):
        assert_grads_close(correct, overflowed)
    assert_grads_close(planted(correct, 1, SMALL, lambda g: g * float("inf")), overflowed)


def test_the_judge_is_exact_arithmetic_at_the_references_weights(ref):
    """Each step's judge gradient is the float64 gradient at the weights the reference's
    forward read (not a float64 trajectory of its own), float64 throughout: the model's
    RMSNorm casts to fp32 (``x.float()``), and a float64 copy run without the mode is
    partly fp32."""
    for step, (ids, labels) in enumerate(batches()):
        model = make_model("llama").double()
        model.load_state_dict({n: w.double() for n, w in ref.weights[step].items()},
                              strict=False)
        with judge.Float64():
            model(ids, labels).backward()
        for n, p in model.named_parameters():
            assert ref.judge.exact[step][n].dtype == torch.float64
            assert torch.allclose(ref.judge.exact[step][n], p.grad, rtol=1e-12, atol=0), n
        model.zero_grad()
        model(ids, labels).backward()  # the RMSNorms in fp32
        assert judge.relative(model.layers[0].input_layernorm.weight.grad,
                              ref.judge.exact[step][SMALL]) > 1e-9


class _Casts(torch.nn.Module):
    def forward(self, x):
        return (x.float(), x.to(torch.float32), torch.softmax(x, -1, dtype=torch.float32),
                torch.zeros(2, dtype=torch.bfloat16), x.to(torch.int64))


def test_float64_mode_keeps_float64_where_a_model_casts_down():
    with judge.Float64():
        out = _Casts()(torch.randn(2, 3, dtype=torch.float64))
    assert [t.dtype for t in out] == [torch.float64] * 4 + [torch.int64]


def test_near_ties_of_a_router_are_counted():
    with judge.Float64(tie_rtol=1e-3) as mode:
        torch.topk(torch.tensor([[1.0, 1.0000001, 0.0], [3.0, 1.0, 0.0]], dtype=torch.float64), 1)
    assert mode.near_ties == 1


def test_a_replica_that_differs_between_ranks_is_named(correct):
    state = make_model("llama").state_dict()
    ranks = [dict(grad_digests=[digests(g) for g in correct], state_digests=digests(state))
             for _ in range(2)]
    assert replica_failures(ranks) is None
    wrong = planted(correct, 2, SMALL, lambda g: g.nextafter(torch.full_like(g, 1.0)))
    ranks[1] = dict(ranks[1], grad_digests=[digests(g) for g in wrong])
    assert replica_failures(ranks) == f"rank 1: step 2: gradient of {SMALL} differs from rank 0's"
