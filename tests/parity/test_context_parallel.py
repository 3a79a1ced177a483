"""Context parallelism on real gloo ranks vs plain single-device PyTorch, GPT (learned positions,
tied embedding) and Llama (rotary tables, GQA): cp=2; cp=4; cp=2 composed with dp=2 and the
distributed optimizer, pp=2 (1F1B, interleaved, ZB-H1: the pipeline sends local sequence slices),
tp=2 (with sequence parallelism), cp2 x tp2 x pp2, recompute, overlapped parameter gathers and
layer-wise sharding (Muon), compiled chunks (torch.compile); and Hugging Face's Llama at cp=2 in
sdpa (a causal mask built from positions, labels shifted inside the model) and eager attention
(matmul, softmax, matmul; also at cp2 x tp2), Llama 4 at cp=2 (its complex rotary table cut to each
rank's positions, chunked attention, the attention temperature, batched experts), Bloom at cp=2
(ALiBi added to the scores by baddbmm, heads merged into the batch dim), and on padded dict batches
(attention_mask kept whole on every cp rank; right-padded sdpa, left-padded sdpa and eager with
position_ids, cp2 x tp2, cp2 x dp2, cp2 x pp2: the mask crosses the pipeline cut) against plain
training on the same dicts. Every batch ignores a different number of leading labels per sample, so
cp ranks count different tokens (some none). Also ``fxmeg::cp_attention`` itself against full causal
attention, values and gradients, with GQA (``enable_gqa``); Engine.verify at cp=2; and the
activations each rank saves."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxmeg
from fxmeg.data.corpus import prepare, read_documents
from fxmeg.data.tokenizer import ByteTokenizer
from fxmeg.diagnostics.measured_activations import SavedBytes
from fxmeg.ir.ops import cp_positions
from fxmeg.train.metrics import read
from fxmeg.train.trainer import TrainConfig, Trainer
from tests.harness.distributed import run_world
from tests.harness.helpers import (
    LOSS_RTOL,
    assert_losses_close,
    assert_weights_close,
    make_batch,
    optimizer,
    reference,
    train_dicts,
)
from tests.harness.models import hf_model, make_model
from tests.parity.scenarios import Scenario, check_parity, train_each
from tests.parity.test_keyword_batches import PAD, padded
from tests.passes.test_context_parallel import MeanSquared, _Encoder, _Window, regression_batches
from tests.passes.test_op_rules import Unbind, ZerosLike

MODELS = ("gpt", "llama")
DIST_OPT = (("distributed_optimizer", True),)
EAGER = (("attn_implementation", "eager"),)
PARITY = (
    [Scenario(m, cp=2) for m in (*MODELS, "hf-llama")]
    + [Scenario("hf-llama", cp=2, model_args=EAGER)]
    + [Scenario(m, cp=2, dp=2, options=DIST_OPT) for m in MODELS]
    + [Scenario(m, cp=4) for m in MODELS]
    + [
        Scenario("gpt", cp=2, pp=2, schedule="1f1b"),
        Scenario("gpt", cp=2, pp=2, vpp=2),
        Scenario("llama", cp=2, pp=2, schedule="zbh1"),
        Scenario("gpt", cp=2, tp=2, options=(("sequence_parallel", True),)),
        Scenario("llama", cp=2, tp=2),
        Scenario("hf-llama", cp=2, tp=2, model_args=EAGER),
        # 8 ranks
        Scenario(
            "llama", cp=2, tp=2, pp=2, schedule="1f1b", options=(("sequence_parallel", True),)
        ),
        Scenario(
            "gpt",
            cp=2,
            dp=2,
            options=(*DIST_OPT, ("overlap_param_gather", True), ("recompute", "full")),
        ),
        Scenario(
            "llama", cp=2, options=(("compile", True),)
        ),  # the cp ops inside inductor's graphs
        Scenario(
            "llama",
            cp=2,
            dp=2,
            opt="muon",
            options=(*DIST_OPT, ("optimizer_sharding", "layerwise"), ("recompute", "selective")),
        ),
        # complex rotary, chunked attention, batched experts per token
        Scenario("moe-llama4_text", cp=2),
        Scenario(
            "hf-bloom", cp=2
        ),  # ALiBi: baddbmm of the scores, heads in and out of the batch dim
    ]
)


@dataclass(frozen=True)
class Padded:
    """Hugging Face's Llama on padded dict batches (test_keyword_batches' ``padded``: 1 in
    ``attention_mask`` for real tokens, pads labelled -100; left padding with position_ids)
    at cp=2: the mask input reaches every cp rank whole, position_ids are cut."""

    side: str
    attn: str
    tp: int = 1
    dp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return 2 * self.tp * self.dp * self.pp

    @property
    def gbs(self) -> int:
        return PADDED_MBS * 2 * self.dp

    @property
    def id(self) -> str:
        return f"{self.side}-{self.attn}-cp2-tp{self.tp}-dp{self.dp}-pp{self.pp}"

    def model(self) -> torch.nn.Module:
        return hf_model("llama", pad_token_id=PAD, attn_implementation=self.attn)

    def batches(self) -> list[dict[str, torch.Tensor]]:
        return [padded(self.gbs, seed=10 * s + len(self.id), side=self.side) for s in range(3)]


PADDED_MBS = 2
PADDED = [
    Padded("right", "sdpa"),
    Padded("left", "sdpa"),
    Padded("left", "eager"),
    Padded("left", "sdpa", tp=2),
    Padded("left", "eager", dp=2),
    Padded("left", "sdpa", pp=2),
]


def train_padded(case: Padded) -> dict:
    data = case.batches()
    engine = fxmeg.parallelize(
        case.model(),
        {k: t[:PADDED_MBS] for k, t in data[0].items()},
        cp=2,
        tp=case.tp,
        pp=case.pp,
        global_batch_size=case.gbs,
        optimizer=optimizer,
    )
    steps = [engine.train_step(b) for b in data]
    return {"losses": [s.loss for s in steps], "tokens": [s.num_tokens for s in steps],
            "dims": engine.program.cp_layout.dims, "state": engine.full_state_dict()}


def attention(rank: int) -> dict:
    """cp-parallel causal attention of this rank's rows vs full attention on one rank."""
    import fxmeg.runtime.collectives  # noqa: F401  (registers the kernels)

    ops, group, cp = torch.ops.fxmeg, dist.group.WORLD.group_name, dist.get_world_size()
    out = {}
    for gqa in (False, True):
        torch.manual_seed(0)
        kv_heads = 2 if gqa else 4
        q = torch.randn(2, 4, 16, 8, requires_grad=True)
        k = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
        v = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        full.backward(torch.ones_like(full))
        mine = torch.tensor(cp_positions(16, cp, rank))
        ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        y = ops.cp_attention(ql, kl, vl, None, gqa, cp, group)
        y.backward(torch.ones_like(y))
        out[gqa] = {
            name: (a, b[:, :, mine])
            for name, a, b in (
                ("out", y, full),
                ("dq", ql.grad, q.grad),
                ("dk", kl.grad, k.grad),
                ("dv", vl.grad, v.grad),
            )
        }
    return out


def saved_bytes(cp: int) -> int:
    """Peak bytes autograd saves on this rank in one step of a 2-layer GPT on sequences
    of 64, micro-batches of 2, at cp=cp (the rest of the two ranks data-parallel)."""
    batches = [make_batch(8, seed=100, seq=64)]
    engine = fxmeg.parallelize(
        make_model("gpt", n_layer=2, seq_len=64),
        tuple(t[:2] for t in batches[0]),
        cp=cp,
        global_batch_size=8,
        optimizer=optimizer,
    )
    meter = SavedBytes(engine.named_parameters.values())
    with meter.hooks():
        engine.train_step(batches[0])
    return meter.peak


SAVED = {"cp": 2, "dp": 2, "distributed_optimizer": True}
TRAINER_MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 4}


def trainer_config(root: str, name: str, **kw) -> TrainConfig:
    base = {
        "data": os.path.join(root, "corpus"),
        "model_args": json.dumps(TRAINER_MODEL),
        "seq_len": 32,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "log_interval": 1,
        "eval_iters": 1,
        "lr": 3e-3,
        "lr_warmup_samples": 8,
        "lr_decay_samples": 200,
        "run_dir": os.path.join(root, name),
        "progress": False,
        "tensorboard": False,
    }
    return TrainConfig.from_flat(**(base | kw))


def checkpoints(root: str) -> dict:
    """The trainer at cp=2 x dp=2 (distributed optimizer): an uninterrupted 4-step run, a
    2-step run that saves, and its checkpoint resumed at cp=1 x dp=4 for 2 more steps."""
    whole = Trainer(trainer_config(root, "whole", train_iters=4, **SAVED))
    whole.run()
    Trainer(
        trainer_config(root, "first", train_iters=2, save=os.path.join(root, "ckpt"), **SAVED)
    ).run()
    resumed = Trainer(
        trainer_config(root, "resumed", train_iters=4, load=os.path.join(root, "ckpt"), dp=4)
    )
    resumed.run()
    return {"whole": whole.engine.full_state_dict(), "resumed": resumed.engine.full_state_dict()}


def window_batches():
    return [make_batch(8, seed=100 + s) for s in range(3)]


def window(rank: int, model=_Window) -> dict:
    """SDPA under a sliding-window mask (built from positions, not causal), or with no
    mask at all (an encoder's), or another small model (``zeros_like``), at cp=2."""
    torch.manual_seed(0)
    batches = window_batches()
    engine = fxmeg.parallelize(model(), tuple(t[:2] for t in batches[0]), cp=2, global_batch_size=8,
                               optimizer=optimizer)
    return {
        "losses": [engine.train_step(b).loss for b in batches],
        "state": engine.full_state_dict(),
    }


def regression(rank: int) -> dict:
    """A plain-mean regression loss at cp=2: its count is the loss pass's constant."""
    torch.manual_seed(0)
    batches = regression_batches()
    engine = fxmeg.parallelize(
        MeanSquared(),
        tuple(t[:2] for t in batches[0]),
        cp=2,
        global_batch_size=8,
        optimizer=optimizer,
    )
    return {
        "losses": [engine.train_step(b).loss for b in batches],
        "state": engine.full_state_dict(),
    }


def run(rank: int, scenarios: list[Scenario], root: str | None = None) -> dict:
    out = train_each(rank, scenarios)
    out["padded"] = {c.id: train_padded(c) for c in PADDED if c.world == dist.get_world_size()}
    if root is not None:
        out["checkpoints"] = checkpoints(root)
    if dist.get_world_size() == 2:
        out["attention"] = attention(rank)
        sc = PARITY[1]  # llama at cp=2: Engine.verify against the single-device graph
        out["verify"] = sc.engine().verify(sc.batches()[0])
        out["saved"] = {cp: saved_bytes(cp) for cp in (1, 2)}
        out["window"] = window(rank)
        out["encoder"] = window(rank, _Encoder)
        out["zeros_like"] = window(rank, ZerosLike)
        out["unbind"] = window(rank, Unbind)
        out["regression"] = regression(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cp"))
    prepare(read_documents(["pydoc:topics"]), os.path.join(root, "corpus"), ByteTokenizer())
    by_world = {w: [s for s in PARITY if s.world == w] for w in sorted({s.world for s in PARITY})}
    # one spawn per world size; the trainer runs in the 4-rank one
    assert list(by_world) == [2, 4, 8]
    out = {
        w: run_world(w, run, scenarios, *([root] if w == 4 else []))
        for w, scenarios in by_world.items()
    }
    return out | {"root": root}


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_matches_single_device(results, sc):
    check_parity([r[sc.id] for r in results[sc.world]], sc)


@pytest.mark.parametrize("case", PADDED, ids=lambda c: c.id)
def test_padded_dict_batches_match_single_device(results, case):
    """The padding mask is not cut (every cp rank reads it whole: its rows are cut where it
    meets attention); position_ids are; every step's loss, the token counts and the final
    weights are single-device training's."""
    ranks = [r["padded"][case.id] for r in results[case.world]]
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"] and r["tokens"] == ranks[0]["tokens"]
    # the mask whole
    assert ranks[0]["dims"] == ((1, None, 1, 1) if case.side == "left" else (1, None, 1))
    losses, ref = train_dicts(case.model(), case.batches())
    assert ranks[0]["tokens"] == [int((b["labels"][:, 1:] != -100).sum()) for b in case.batches()]
    assert_losses_close(ranks[0]["losses"], losses)
    assert_weights_close(ranks[0]["state"], ref.state_dict())


def test_activations_per_rank_shrink_with_cp(results):
    """Each rank saves its 1/cp of the activations, plus the gathered keys and values of
    every layer: at most 0.6x of cp=1's for the same model and micro-batch."""
    for r in results[2]:
        assert r["saved"][2] <= 0.6 * r["saved"][1], r["saved"]


@pytest.mark.parametrize(
    "name,model",
    [("window", _Window), ("encoder", _Encoder), ("zeros_like", ZerosLike), ("unbind", Unbind)],
)
def test_a_sliding_window_no_mask_or_zeros_like_matches_single_device(results, name, model):
    torch.manual_seed(0)
    losses, _, state = reference(model(), window_batches())
    for r in results[2]:
        assert_losses_close(r[name]["losses"], losses)
    assert_weights_close(results[2][0][name]["state"], state)


def test_a_plain_mean_loss_matches_single_device(results):
    """x.mean() counts its elements: each cp rank counts its share (it counted the whole
    sequence on every rank, and trained at 1/cp of the loss and gradients)."""
    torch.manual_seed(0)
    losses, _, state = reference(MeanSquared(), regression_batches())
    for r in results[2]:
        assert_losses_close(r["regression"]["losses"], losses)
    assert_weights_close(results[2][0]["regression"]["state"], state)


def test_verify_agrees_with_single_device(results):
    for r in results[2]:
        assert r["verify"].ok, r["verify"]


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_attention_ops_match_full_causal_attention(results, gqa):
    for r in results[2]:
        for name, (got, want) in r["attention"][gqa].items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)



def _losses(root: str, name: str) -> list[float]:
    return [r["loss"] for r in read(os.path.join(root, name)) if r["kind"] == "train"]


def test_trainer_checkpoint_at_cp2_resumes_at_cp1(results):
    """The trainer runs cp=2 x dp=2; its checkpoint (every cp rank a replica of the
    parameters, the optimizer sharded over dp x cp) loads at cp=1 x dp=4 and the run goes
    on as the uninterrupted one."""
    root, ranks = results["root"], results[4]
    whole, resumed = _losses(root, "whole"), _losses(root, "resumed")
    assert len(whole) == 4 and len(resumed) == 2
    for g, w in zip(resumed, whole[2:]):
        assert abs(g - w) <= LOSS_RTOL * abs(w), (g, w)
    state = ranks[0]["checkpoints"]
    assert_weights_close(state["resumed"], state["whole"])

