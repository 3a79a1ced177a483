"""Expert parallelism (fxmeg/passes/expert_parallel.py, fxmeg/runtime/experts.py) on real
gloo ranks against single-device training of the same Hugging Face mixture of experts
(built with ``AutoModelForCausalLM.from_config``, nothing set by hand: 4 experts, top-2).

One 2-rank spawn: Mixtral, Qwen2-MoE (a shared expert), Qwen3-MoE, OLMoE, DeepSeek-V3
(latent attention, group-limited routing, a dense first layer) and GPT-OSS (biased
experts, clamped GLU) at ep=2 (dp=2: each rank holds half the experts). One 4-rank
spawn: ep=2 over dp=4 with the distributed optimizer (two expert-data-parallel
replicas), ep=2 x pp=2 (1F1B and interleaved), ep=2 x tp=2 (experts replicated over tp),
ep=4 (one expert per rank), and Mixtral's router loss at ep=2 x pp=2, m=4, weighted per
micro-batch. Each rank holds exactly E / ep experts of every layer, and the expert
gradients are reduced over the expert-data-parallel ranks only (the groups their
buffers reduce over)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fxmeg.runtime.groups import Topology
from tests.distributed import run_worlds
from tests.helpers import MOE
from tests.parity.scenarios import Scenario, check_parity, check_router_loss, train

EP2 = [Scenario(f"moe-{kind}", dp=2, options=(("ep", 2),)) for kind in sorted(MOE)]
FOUR = [
    Scenario("moe-mixtral", dp=4, options=(("ep", 2), ("distributed_optimizer", True))),
    Scenario("moe-qwen2_moe", dp=4, options=(("ep", 2), ("distributed_optimizer", True))),
    Scenario("moe-mixtral", dp=2, pp=2, options=(("ep", 2),)),
    Scenario("moe-olmoe", dp=2, pp=2, vpp=2, options=(("ep", 2),)),
    Scenario("moe-mixtral", dp=2, tp=2, options=(("ep", 2),)),
    Scenario("moe-qwen3_moe", dp=4, options=(("ep", 4),)),
]
ROUTER_LOSS = Scenario("hf-mixtral", dp=2, pp=2, options=(("ep", 2),))  # batched_mm: captured grouped
ALL = EP2 + FOUR + [ROUTER_LOSS]


def held(rank: int, engine) -> dict:
    """What expert parallelism must hold on this rank: every parameter's local shape, the
    banks' splits, and the ranks each gradient buffer reduces over."""
    ctx = engine.context
    return dict(
        rank=rank,
        shapes={n: tuple(p.shape) for n, p in ctx.named_parameters.items()},
        ep_specs=dict(engine.program.ep_specs),
        reduced_over={buf.label: sorted(dist.get_process_group_ranks(buf.group)) if buf.group is not None
                      else [rank] for buf in ctx.ddp.all()},
    )


def train_ep(rank: int, scenarios: list[Scenario]) -> dict:
    return {sc.id: train(rank, sc, held) for sc in scenarios}


@pytest.fixture(scope="module")
def results():
    return run_worlds(train_ep, ALL, (2, 4))


def _ranks(results, sc) -> list[dict]:
    return [r[sc.id] for r in results[sc.world]]


@pytest.mark.parametrize("sc", EP2 + FOUR, ids=lambda s: s.id)
def test_parity(results, sc):
    check_parity(_ranks(results, sc), sc)


@pytest.mark.parametrize("sc", EP2 + FOUR, ids=lambda s: s.id)
def test_each_rank_holds_its_experts_and_reduces_them_over_their_holders(results, sc):
    ep = dict(sc.options)["ep"]
    full = {n: tuple(t.shape) for n, t in sc.make_model().named_parameters()}
    topo = Topology(tp=sc.tp, pp=sc.pp, dp=sc.dp, ep=ep)
    for r in _ranks(results, sc):
        specs = r["ep_specs"]
        layers = {s.origin for s in specs.values()}
        assert len(layers) == sc.layers - (sc.model == "moe-deepseek_v3"), layers  # DeepSeek's layer 0 is dense
        for name, spec in specs.items():
            if name not in r["shapes"]:
                continue  # another pipeline rank's layer
            assert spec.experts == 4 and r["shapes"][name] == (4 // ep, *full[name][1:]), name
        held = {n for n in specs if n in r["shapes"]}
        assert held, "this rank holds no experts"
        assert sum(_numel(r["shapes"][n]) for n in held) * ep == sum(_numel(full[n]) for n in held)
        ep_group = next(g for g in topo.ep_groups() if r["rank"] in g)
        edp = next(g for g in topo.edp_groups() if r["rank"] in g)
        dense = next(g for g in topo.dp_cp_groups() if r["rank"] in g)
        assert len(ep_group) == ep and set(edp) & set(ep_group) == {r["rank"]}
        for label, ranks in r["reduced_over"].items():
            assert ranks == (edp if label.endswith("/experts") else dense), (label, ranks)
        assert any(label.endswith("/experts") for label in r["reduced_over"])


def test_router_loss_at_ep2_pp2_is_weighted_per_micro_batch(results):
    check_router_loss(_ranks(results, ROUTER_LOSS), ROUTER_LOSS)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
