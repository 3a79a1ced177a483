"""Tokens per expert in one process (fxmeg/runtime/expert_load.py): the expert-parallel pass's
``expert_load`` markers at ep=1, the counts against a hand count of the model's own
routing, each micro-batch counted once (activation recompute, a determinism rerun,
evaluation), and what the trainer writes and plots. Loss-free balancing
(``moe_router_bias_update_rate``) on DeepSeek-V3 against the same training written out
in plain PyTorch, through a checkpoint, and its refusals."""

from __future__ import annotations

import copy
import json
import operator
from unittest import mock

import pytest
import torch
from torch import nn

import fxmeg
from fxmeg.config import make_config
from fxmeg.errors import ConfigError, PassError
from fxmeg.frontend.pass_driver import transform
from fxmeg.ir.program import chunks, load_marks
from fxmeg.passes.recompute import Recompute
from fxmeg.train.metrics import plot, read
from fxmeg.train.trainer import TrainConfig, Trainer
from fxmeg.weights.checkpoint import Checkpointer
from tests.harness.helpers import (
    assert_losses_close,
    assert_weights_close,
    graph_after,
    make_batch,
    model_loss,
    optimizer,
    reference_groups,
)
from tests.harness.models import make_model, tiny_moe

GBS, MBS = 4, 2


def hand_counts(model: nn.Module, ids: torch.Tensor) -> dict[str, list[int]]:
    """Tokens per expert of the model's own forward on ``ids``: the top-k index each
    experts module receives, counted."""
    counts: dict[str, list[int]] = {}

    def hook(name):
        def count(module, args):
            index = args[1]  # (hidden_states, top_k_index, top_k_weights)
            counts[name] = torch.bincount(index.reshape(-1), minlength=module.num_experts).tolist()
        return count

    model = copy.deepcopy(model)
    handles = [
        m.register_forward_pre_hook(hook(n))
        for n, m in model.named_modules()
        if n.endswith("mlp.experts")
    ]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return counts


def _engine(model, batch, **options):
    return fxmeg.parallelize(model, tuple(t[:MBS] for t in batch), global_batch_size=GBS, **options)


def test_the_pass_only_marks_each_block_at_ep1():
    """At ep=1 the pass adds one marker per block right after its top-k index, naming the
    experts module, and changes nothing else."""
    model, batch = tiny_moe("qwen2_moe"), make_batch(MBS, seed=0, vocab=96)
    before = graph_after(model, batch, "pipeline").chunk_0.code
    after = chunks(graph_after(model, batch, "expert_parallel"))[0]
    marks = load_marks(after)
    assert [(m.kwargs, m.args[0].args[1]) for m in marks] == [
        ({"layer": f"model.layers.{i}.mlp.experts", "experts": 4, "bias": None}, 1)
        for i in range(2)
    ]
    assert all(m.prev is m.args[0] and m.args[0].target is operator.getitem for m in marks)
    kept = [ln for ln in after.code.splitlines() if "fxmeg_ir_ops_expert_load" not in ln]
    assert kept == before.splitlines()


class _Unreadable(nn.Module):
    """Two grouped matmuls over 3-D banks whose offsets are fixed, not counted from a
    router's top-k: no block fxmeg can read."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 16)])
        self.up = nn.Parameter(torch.randn(2, 16, 16) / 4)
        self.down = nn.Parameter(torch.randn(2, 16, 16) / 4)
        self.head = nn.Linear(16, 128)

    def forward(self, ids, labels):
        from transformers.integrations.moe import _grouped_mm

        x = self.layers[0](ids).flatten(0, 1)
        offsets = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        y = _grouped_mm(_grouped_mm(x, self.up, offsets).relu(), self.down, offsets)
        return nn.functional.cross_entropy(self.head(y), labels.flatten())


def test_an_unreadable_block_is_not_counted_at_ep1_and_refused_at_ep2():
    batch = make_batch(2, seed=0)
    gm = chunks(graph_after(_Unreadable(), batch, "expert_parallel"))[0]
    assert not load_marks(gm)
    with pytest.raises(PassError, match="not cumsum\\(histc\\(expert ids\\)\\)"):
        graph_after(_Unreadable(), batch, "expert_parallel", dp=2, ep=2)
    # the bias update reads every block
    with pytest.raises(PassError, match="not cumsum\\(histc\\(expert ids\\)\\)"):
        graph_after(_Unreadable(), batch, "expert_parallel", moe_router_bias_update_rate=1e-3)


def test_counts_are_the_models_own_routing_once_per_micro_batch():
    """Step 1's counts are the hand count on the global batch; a rerun for determinism
    and an evaluation add nothing."""
    model, batch = tiny_moe("mixtral"), make_batch(GBS, seed=1, vocab=96)
    want = hand_counts(model, batch[0])
    engine = _engine(model, batch)
    result = engine.train_step(batch, check_determinism=True)
    assert {k: list(v) for k, v in result.expert_load.items()} == want
    assert sum(want["model.layers.0.mlp.experts"]) == GBS * 16 * 2  # every (token, slot) pair
    assert result.load_imbalance == {k: max(v) / (sum(v) / 4) for k, v in want.items()}
    counted = engine.context.load.counts.clone()
    engine.eval_step(batch)
    assert torch.equal(engine.context.load.counts, counted)


def test_recompute_does_not_count_twice():
    """Under full recompute the markers run again in backward; those runs are not counted
    (without that guard every count doubles). lr 0: every step routes alike."""
    model, batch = tiny_moe("olmoe"), make_batch(GBS, seed=2, vocab=96)
    want = hand_counts(model, batch[0])
    engine = _engine(
        model, batch, recompute="full", optimizer=lambda groups: torch.optim.SGD(groups, lr=0.0)
    )
    regions = [
        m.region for gm in engine.program.chunks for m in gm.modules() if isinstance(m, Recompute)
    ]
    # the markers run inside the recomputed blocks
    assert sum(len(load_marks(r)) for r in regions) == 2
    assert {k: list(v) for k, v in engine.train_step(batch).expert_load.items()} == want
    with mock.patch.object(engine.context.recomputation, "recomputing", return_value=False):
        doubled = engine.train_step(batch).expert_load
    assert {k: [c // 2 for c in v] for k, v in doubled.items()} == want
    assert all(c % 2 == 0 for v in doubled.values() for c in v) and doubled != want


MIXTRAL = json.dumps(
    {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
)


def test_the_trainer_logs_and_plots_the_load(corpus, tmp_path):
    run = str(tmp_path / "run")
    cfg = TrainConfig.from_flat(
        data=corpus,
        model="transformers:MixtralForCausalLM",
        model_args=MIXTRAL,
        seq_len=16,
        micro_batch_size=2,
        global_batch_size=4,
        train_iters=4,
        log_interval=2,
        eval_iters=1,
        lr=1e-3,
        run_dir=run,
        progress=False,
        tensorboard=True,
    )
    Trainer(cfg).run()
    train = [r for r in read(run) if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [2, 4]
    layers = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for r in train:
        assert list(r["tokens_per_expert"]) == list(r["load_imbalance"]) == layers
        # 2 steps
        assert all(
            sum(c) == 2 * 4 * 16 * 2 and len(c) == 4 for c in r["tokens_per_expert"].values()
        )
        assert all(1.0 <= x <= 4.0 for x in r["load_imbalance"].values())
        assert r["load_imbalance_max"] == max(r["load_imbalance"].values())
    assert plot(run).endswith("curves.png")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{run}/tensorboard")
    events.Reload()
    for layer in layers:  # one curve per layer
        got = [(e.step, e.value) for e in events.Scalars(f"train/load_imbalance/{layer}")]
        assert got == [(r["iteration"], pytest.approx(r["load_imbalance"][layer])) for r in train]


# ---------------------------------------------------------------- loss-free balancing

RATE = 0.05  # large enough to move tokens between experts within three steps
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # DeepSeek-V3's layer 0 is dense


def balancing_reference(model: nn.Module, batches, rate: float):
    """Plain PyTorch: mean loss over each global batch, the parity AdamW, clipping at 1;
    after each optimizer step every router's e_score_correction_bias moves by
    rate * sign(mean - counts) of that step's tokens per expert, counted from the router's
    own top-k indices (Megatron's get_updated_expert_bias). Returns (losses, the counts of
    each step, the trained copy)."""
    ref = copy.deepcopy(model)
    opt = optimizer(reference_groups(ref.named_parameters()))
    routers = {
        n.removesuffix(".gate") + ".experts": m
        for n, m in ref.named_modules()
        if n.endswith("mlp.gate")
    }
    counts: dict[str, torch.Tensor] = {}

    def hook(layer):
        def count(module, args, output):
            index = output[2]  # (router_logits, top_k_weights, top_k_index)
            counts[layer] = counts.get(layer, 0) + torch.bincount(
                index.reshape(-1), minlength=module.num_experts
            )

        return count

    for layer, router in routers.items():
        router.register_forward_hook(hook(layer))
    losses, per_step = [], []
    for ids, labels in batches:
        counts.clear()
        opt.zero_grad()
        loss = model_loss(ref, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for layer, router in routers.items():
                c = counts[layer].float()
                router.e_score_correction_bias += torch.sign(c.mean() - c) * rate
        losses.append(loss.item())
        per_step.append({k: v.tolist() for k, v in counts.items()})
    return losses, per_step, ref


def test_loss_free_balancing_equals_plain_pytorch_and_resumes(tmp_path):
    """DeepSeek-V3, 3 steps of 2 micro-batches: losses, counts, weights and the bias
    buffer as the plain loop; a checkpoint after step 2 holds the bias, and an engine
    resumed from it trains step 3 alike."""
    model = tiny_moe("deepseek_v3")
    batches = [make_batch(GBS, seed=20 + s, vocab=96) for s in range(3)]
    losses, counts, ref = balancing_reference(model, batches, RATE)
    _, unbalanced, _ = balancing_reference(model, batches, 0.0)
    assert counts[0] == unbalanced[0] and counts[1:] != unbalanced[1:]  # the bias moved tokens
    engine = _engine(
        copy.deepcopy(model), batches[0], moe_router_bias_update_rate=RATE, optimizer=optimizer
    )
    results = []
    for i, b in enumerate(batches):
        results.append(engine.train_step(b))
        if i == 1:
            Checkpointer(engine.program, engine.context).save(str(tmp_path), 2, {})
    assert_losses_close([r.loss for r in results], losses)
    assert [{k: list(v) for k, v in r.expert_load.items()} for r in results] == counts
    state = engine.full_state_dict()
    assert_weights_close(state, ref.state_dict())
    assert torch.equal(state[BIAS], ref.get_buffer(BIAS)) and state[BIAS].abs().sum() > 0
    resumed = _engine(
        copy.deepcopy(model), batches[0], moe_router_bias_update_rate=RATE, optimizer=optimizer
    )
    Checkpointer(resumed.program, resumed.context).load(str(tmp_path))
    loaded = resumed.full_state_dict()[BIAS]  # step 2's bias, before step 3's update
    assert loaded.abs().sum() > 0 and not torch.equal(loaded, state[BIAS])
    assert resumed.train_step(batches[2]).loss == results[2].loss
    assert all(torch.equal(t, state[k]) for k, t in resumed.full_state_dict().items())


def test_loss_free_balancing_is_refused_without_a_router_bias():
    batch = make_batch(MBS, seed=0, vocab=96)
    with pytest.raises(
        PassError,
        match=r"the router of the experts 'model.layers.0.mlp.experts' adds no 1-D "
        r"buffer of 4 values .* train this model with moe_router_bias_update_rate=0",
    ):
        graph_after(tiny_moe("mixtral"), batch, "expert_parallel", moe_router_bias_update_rate=1e-3)
    with pytest.raises(
        PassError, match="moe_router_bias_update_rate=0.001, but fxmeg finds no routed experts"
    ):
        transform(make_model("gpt"), make_batch(MBS, seed=0), moe_router_bias_update_rate=1e-3)


@pytest.mark.parametrize("options, refusal", [
    (dict(moe_router_bias_update_rate=-1e-3), "must be a finite number >= 0"),
    (dict(moe_router_bias_update_rate=float("nan")), "must be a finite number >= 0"),
    (dict(moe_router_bias_update_rate=1e-3, compile=True), "does not run with compile=True"),
    (dict(moe_router_bias_update_rate=1e-3, pp=2, schedule="zbh1", global_batch_size=8),
     "does not run with schedule='zbh1'"),
])
def test_the_rate_is_checked(options, refusal):
    with pytest.raises(ConfigError, match=refusal):
        make_config(make_batch(MBS, seed=0), world=None, **options)
