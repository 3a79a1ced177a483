"""The layer-wise distributed optimizer's pieces without processes: the assignment of whole
parameters to data-parallel ranks, the optimizer plan (which inner optimizer takes which
parameter, elementwise or not, and the sharding it implies), the Muon + AdamW groups, and
one-process training with several inner optimizers."""

from __future__ import annotations

import random

import pytest
import torch

import fxmeg
from fxmeg.config_sections import DataParallelConfig
from fxmeg.errors import ConfigError
from fxmeg.ir.layouts import Shard
from fxmeg.lr_schedule import LRSchedule
from fxmeg.runtime.optimizer.layerwise import assign
from fxmeg.runtime.optimizer.optimizer import (
    is_elementwise,
    muon_adamw,
    muon_groups,
    param_groups,
    plan_optimizers,
)
from fxmeg.sharding_modes import OptimizerSharding
from fxmeg.weights.sharding import tp_assemble, tp_shard
from tests.harness.helpers import (
    assert_losses_close,
    assert_weights_close,
    make_batch,
    optimizer,
    reference,
)
from tests.harness.models import make_model

SIZES = {"a": 4096, "b": 4096, "c": 3072, "d": 1024, "e": 1024, "f": 512, "g": 32, "h": 32, "i": 32}


def test_assign_is_balanced_and_covers_every_parameter_once():
    for ranks in (1, 2, 3, 4):
        owner = assign(SIZES, ranks)
        assert set(owner) == set(SIZES) and set(owner.values()) <= set(range(ranks))
        loads = [sum(SIZES[n] for n in SIZES if owner[n] == r) for r in range(ranks)]
        assert sum(loads) == sum(SIZES.values())
        assert max(loads) - min(loads) <= max(SIZES.values())  # greedy: within one parameter
    assert assign(SIZES, 2) == {
        "a": 0,
        "b": 1,
        "c": 0,
        "d": 1,
        "e": 1,
        "f": 1,
        "g": 1,
        "h": 1,
        "i": 1,
    }
    assert set(assign(SIZES, 1).values()) == {0}


def test_assign_is_deterministic_whatever_the_order():
    names = list(SIZES)
    for seed in range(5):
        random.Random(seed).shuffle(names)
        assert assign({n: SIZES[n] for n in names}, 3) == assign(SIZES, 3)


def test_tp_assemble_inverts_tp_shard_with_blocks():
    full = torch.arange(12 * 4.0).view(12, 4)
    spec = Shard(0, (4, 4, 4))  # a fused QKV: every block split in tp parts
    shards = [tp_shard(full, spec, 2, r) for r in range(2)]
    assert torch.equal(tp_assemble(shards, spec), full)
    assert torch.equal(shards[1][:2], full[2:4])


def test_is_elementwise_knows_torch_optimizers_and_reads_declarations():
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert is_elementwise(torch.optim.AdamW(p)) is True
    assert is_elementwise(torch.optim.SGD(p, lr=0.1)) is True
    assert is_elementwise(torch.optim.Muon(p)) is False
    assert is_elementwise(torch.optim.Adafactor(p)) is False

    class Custom(torch.optim.SGD):
        pass

    class Shampoo(torch.optim.SGD):
        elementwise = False

    assert is_elementwise(Custom(p, lr=0.1)) is True  # a subclass inherits what fxmeg knows
    assert is_elementwise(Shampoo(p, lr=0.1)) is False  # unless it declares otherwise
    assert is_elementwise(torch.optim.LBFGS(p)) is None


def _template():
    return param_groups(make_model("gpt", n_layer=2).named_parameters())


def test_plan_routes_matrices_to_muon_and_picks_the_sharding():
    plan = plan_optimizers(muon_adamw(), _template(), torch.device("cpu"))
    assert plan.kinds == ("Muon", "AdamW") and plan.elementwise == (False, True)
    assert plan.route["layers.0.attn.qkv.weight"] == 0 and plan.route["wte.weight"] == 1
    assert plan.route["layers.0.ln_1.weight"] == 1
    assert plan.whole("layers.0.attn.qkv.weight") and not plan.whole("wte.weight")
    assert plan.sharding(False, "auto") == "none"
    assert plan.sharding(True, "auto") == "layerwise"
    with pytest.raises(
        ConfigError, match="optimizer_sharding='elementwise' .* Muon needs whole parameters"
    ):
        plan.sharding(True, "elementwise")
    with pytest.raises(
        ConfigError, match="overlap_param_gather=True needs optimizer_sharding='elementwise'"
    ):
        plan.sharding(True, "auto", overlap_param_gather=True)
    adam = plan_optimizers(optimizer, _template(), torch.device("cpu"))
    assert (
        adam.sharding(True, "auto") == "elementwise"
        and adam.sharding(True, "layerwise") == "layerwise"
    )


def test_plan_refuses_a_factory_that_misses_or_repeats_a_parameter():
    def missing(groups):
        return torch.optim.AdamW(groups[:1])

    def twice(groups):
        return [torch.optim.AdamW(groups), torch.optim.SGD(groups[1:], lr=0.1)]

    with pytest.raises(ConfigError, match=r"parameter\(s\) are in no optimizer"):
        plan_optimizers(missing, _template(), torch.device("cpu"))
    with pytest.raises(ConfigError, match="is in optimizer 0 and optimizer 1"):
        plan_optimizers(twice, _template(), torch.device("cpu"))


def test_muon_groups_keep_every_group_and_its_options():
    groups = _template()
    matrices, rest = muon_groups(groups)
    assert [g["wd_mult"] for g in matrices] == [g["wd_mult"] for g in rest] == [1.0, 0.0]
    assert "wte.weight" in rest[0]["param_names"] and "wpe.weight" in rest[0]["param_names"]
    assert all(p.dim() == 2 for g in matrices for p in g["params"]) and not matrices[1]["params"]
    names = [n for g in matrices + rest for n in g["param_names"]]
    assert sorted(names) == sorted(n for g in groups for n in g["param_names"])


def _muon_run(**options):
    from tests.harness.helpers import muon

    batches = [make_batch(8, seed=100 + s) for s in range(3)]
    engine = fxmeg.parallelize(make_model("gpt", n_layer=2), tuple(t[:2] for t in batches[0]),
                               global_batch_size=8, optimizer=muon, **options)
    return engine, batches, [engine.train_step(b) for b in batches]


@pytest.mark.parametrize(
    "options", [{}, {"distributed_optimizer": True}], ids=["replicated", "layerwise-dp1"]
)
def test_one_process_muon_and_adamw_match_plain_pytorch(options):
    engine, batches, steps = _muon_run(**options)
    want_losses, want_norms, want = reference(make_model("gpt", n_layer=2), batches, opt="muon")
    assert engine.context.optimizer.sharding == ("layerwise" if options else "none")
    assert_losses_close([s.loss for s in steps], want_losses)
    assert_losses_close([s.grad_norm for s in steps], want_norms, rtol=1e-4)
    assert_weights_close(engine.full_state_dict(), want)


def test_lr_schedule_drives_every_inner_optimizer_keeping_adamw_lr_ratio():
    batches = [make_batch(4, seed=s) for s in range(2)]
    engine = fxmeg.parallelize(
        make_model("gpt", n_layer=2), tuple(t[:2] for t in batches[0]), global_batch_size=4,
        optimizer=muon_adamw(lr=0.02, adamw_lr=0.002),
        lr_schedule=LRSchedule(max_lr=0.02, warmup_samples=8, decay_samples=100),
    )
    engine.train_step(batches[0])
    muon, adam = engine.context.optimizer.optimizers
    # half-way through warmup
    assert [g["lr"] for g in muon.param_groups] == pytest.approx([0.01, 0.01])
    assert [g["lr"] for g in adam.param_groups] == pytest.approx([0.001, 0.001])
    assert engine.train_step(batches[1]).lr == pytest.approx(0.01)  # the first (Muon) group's


def test_a_factory_routing_by_the_masters_shape_is_refused_under_flat_shards():
    def by_dim(groups):  # flat elementwise shards are 1-D: this routes differently on them
        params = [p for g in groups for p in g["params"]]
        return [torch.optim.AdamW([{"params": [p for p in params if p.dim() == 2]}]),
                torch.optim.SGD([{"params": [p for p in params if p.dim() != 2]}], lr=0.1)]

    with pytest.raises(ConfigError, match="route by group\\['param_names'\\]"):
        fxmeg.parallelize(make_model("gpt", n_layer=2), make_batch(2, seed=0), optimizer=by_dim,
                          distributed_optimizer=True, optimizer_sharding="elementwise")


def test_config_checks_the_sharding_name_and_its_companions():
    with pytest.raises(
        ConfigError, match="optimizer_sharding='layerwsie' is not one of .*did you mean 'layerwise'"
    ):
        DataParallelConfig(distributed_optimizer=True, optimizer_sharding="layerwsie")
    with pytest.raises(
        ConfigError, match="optimizer_sharding='layerwise' needs distributed_optimizer=True"
    ):
        DataParallelConfig(optimizer_sharding="layerwise")
    with pytest.raises(
        ConfigError, match="overlap_param_gather=True needs optimizer_sharding='elementwise'"
    ):
        DataParallelConfig(
            distributed_optimizer=True, optimizer_sharding="layerwise", overlap_param_gather=True
        )


def _padded_for_flat_shards(engine) -> bool:
    (layout,) = engine.program.buffers[0]
    return layout.numel % 128 == 0 and all(s.offset % 64 == 0 for s in layout.slots)


def test_the_sharding_is_decided_once_and_the_buckets_pass_reads_it():
    """parallelize decides 'auto' from what the factory builds and records it; the buckets
    pass lays the buffers out for that decision: flat-shard padding (parameters at
    multiples of 64 elements) for AdamW's elementwise shards, none for Muon's layer-wise
    owners."""
    batch = make_batch(2, seed=0)
    muon = fxmeg.parallelize(
        make_model("gpt", n_layer=2), batch, optimizer=muon_adamw(), distributed_optimizer=True
    )
    adam = fxmeg.parallelize(make_model("gpt", n_layer=2), batch, distributed_optimizer=True)
    assert (
        muon.config.data_parallel.decided_sharding
        is OptimizerSharding.LAYERWISE
        is muon.context.optimizer.sharding
    )
    assert (
        adam.config.data_parallel.decided_sharding
        is OptimizerSharding.ELEMENTWISE
        is adam.context.optimizer.sharding
    )
    assert _padded_for_flat_shards(adam) and not _padded_for_flat_shards(muon)
    # no factory
    assert DataParallelConfig(distributed_optimizer=True).sharding is OptimizerSharding.ELEMENTWISE
    with pytest.raises(
        ConfigError, match="decided_sharding='layerwise' contradicts distributed_optimizer=False"
    ):
        DataParallelConfig(decided_sharding=OptimizerSharding.LAYERWISE)
    with pytest.raises(ConfigError, match="unknown option 'decided_sharding'"):
        fxmeg.parallelize(
            make_model("gpt", n_layer=2), batch, decided_sharding=OptimizerSharding.NONE
        )
