"""Tensor parallelism on real gloo ranks vs plain single-device PyTorch: tp=2, with
sequence parallelism, with pp=2, and tp=2 x pp=2 x dp=2 with the distributed optimizer,
for GPT (tied vocabulary-parallel embedding and head) and Llama (GQA); and at tp=2 the small
models of the graph tests that exercise one rule each (layer_norm over split features, a sum
read whole, cat of split blocks, einsum attention with a per-head bias, zeros_like, and the
head layouts of tests/passes/test_tp_ops.py: heads merged into the batch of bmm / baddbmm,
a fused q / k / v unbound, index.Tensor, softmax / amax / amin over the heads, one fused
projection replicated by tp_plan)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxmeg
from fxmeg.ir.layouts import Replicate, Shard
from tests.harness.distributed import run_worlds
from tests.harness.helpers import (
    assert_losses_close,
    assert_weights_close,
    make_batch,
    optimizer,
    reference,
)
from tests.harness.models import make_model
from tests.parity.scenarios import Scenario, check_parity, train_each
from tests.passes.test_op_rules import ZerosLike
from tests.passes.test_tensor_parallel import _CatStack, _EinsumAttention, _NormedMLP, _SplitSum
from tests.passes.test_tp_ops import KINDS, PLANS, _Heads

MODELS = ("gpt", "llama")
PARITY = [Scenario(m, tp=2) for m in MODELS] + [
    Scenario(m, tp=2, options=(("sequence_parallel", True),)) for m in MODELS
] + [
    Scenario(m, tp=2, pp=2, schedule="1f1b") for m in MODELS
] + [
    Scenario(m, tp=2, pp=2, dp=2, schedule="1f1b", options=(("distributed_optimizer", True),))
    for m in MODELS
]


def compiled_collectives(rank: int) -> dict:
    """The registered ops trace through torch.compile (dynamo + AOT autograd) and give
    the eager values and gradients."""
    import fxmeg.runtime.collectives  # noqa: F401  (registers the kernels)

    name = dist.group.WORLD.group_name
    w = torch.full((4, 4), float(rank + 1), requires_grad=True)

    def f(x):
        y = torch.ops.fxmeg.tp_copy.default(x, name) @ w
        return torch.ops.fxmeg.tp_reduce.default(y, name).sum()

    x1 = torch.ones(2, 4, requires_grad=True)
    x2 = torch.ones(2, 4, requires_grad=True)
    eager = f(x1)
    eager.backward()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x2)
    compiled.backward()
    return dict(eager=float(eager), compiled=float(compiled),
                grads_equal=bool(torch.equal(x1.grad, x2.grad)), grad=x1.grad.tolist())


RULES = {
    "layer-norm": _NormedMLP,
    "sum-read-whole": _SplitSum,
    "sum-read-both": lambda: _SplitSum(mixed=True),
    "cat-blocks": _CatStack,
    "einsum-bias": _EinsumAttention,
    "zeros-like": ZerosLike,
}
# issue 28's layouts (test_tp_ops)
RULES |= {kind: lambda kind=kind: _Heads(kind) for kind in KINDS}


def _rule_model(name):
    torch.manual_seed(0)
    return RULES[name]()


def _rule_batches():
    return [make_batch(8, seed=100 + s) for s in range(3)]


def train_rules(rank: int) -> dict:
    """Each rule's model at tp=2: losses and the gathered state."""
    out = {}
    for name in RULES:
        batches = _rule_batches()
        engine = fxmeg.parallelize(_rule_model(name), tuple(t[:2] for t in batches[0]), tp=2,
                                   global_batch_size=8, optimizer=optimizer, clip_grad=1.0,
                                   tp_plan=PLANS.get(name, {}))
        losses = [engine.train_step(b).loss for b in batches]
        out[name] = (losses, engine.full_state_dict())
    return out


def run(rank: int, scenarios: list[Scenario]) -> dict:
    out = train_each(rank, scenarios)
    if dist.get_world_size() == 2:
        out["compile"] = compiled_collectives(rank)
        out["rules"] = train_rules(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_worlds(run, PARITY, (2, 4, 8))


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_parity(results, sc):
    check_parity([r[sc.id] for r in results[sc.world]], sc)


@pytest.mark.parametrize("sc", [s for s in PARITY if s.pp == 1], ids=lambda s: s.id)
def test_each_rank_holds_its_shards_only(results, sc):
    model = make_model(sc.model, n_layer=sc.layers)
    for r in results[sc.world]:
        specs = r[sc.id]["tp_specs"]
        sharded = sum(p.numel() for n, p in model.named_parameters() if isinstance(specs[n], Shard))
        replicated = sum(
            p.numel() for n, p in model.named_parameters() if isinstance(specs[n], Replicate)
        )
        assert sharded and replicated
        assert r[sc.id]["param_elements"] == sharded // sc.tp + replicated


def test_registered_collectives_work_under_torch_compile(results):
    for r in results[2]:
        c = r["compile"]
        assert c["eager"] == c["compiled"] and c["grads_equal"]
        # rank r's input gradient is w_r's row sum, 4 * (r + 1); f's backward all-reduces
        assert c["grad"] == [[4.0 * 1 + 4.0 * 2] * 4] * 2


@pytest.mark.parametrize("name", list(RULES))
def test_each_rule_trains_like_one_device(results, name):
    want_losses, _, want_state = reference(_rule_model(name), _rule_batches())
    for r in results[2]:
        losses, _ = r["rules"][name]
        assert_losses_close(losses, want_losses)
    assert_weights_close(results[2][0]["rules"][name][1], want_state)
