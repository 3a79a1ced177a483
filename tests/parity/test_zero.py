"""ZeRO-2 and ZeRO-3 on real gloo ranks: parity with single-device training in every
composition docs/zero.md lists, what each rank holds between steps (its 1 / (dp x cp) of
the stage's gradients and, at zero=3, parameters; counted from the tensors themselves),
when zero=3 gathers and frees, bf16 masters, and checkpoints moved between zero=3 on dp4
and zero=1 on tp2 x dp2 in both directions."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import fxmeg
from fxmeg.weights.meta_init import Source
from models.gpt import GPT, GPTConfig
from tests.harness.distributed import run_world
from tests.harness.helpers import (
    assert_bitwise,
    assert_losses_close,
    assert_weights_close,
    make_batch,
    optimizer,
)
from tests.harness.helpers import reference as plain_reference
from tests.harness.models import make_model
from tests.parity.mixed_precision import check_sharded_bf16, master_pieces
from tests.parity.scenarios import (
    MBS,
    Scenario,
    check_optimizer_share,
    check_parity,
    check_router_loss,
    train,
)

Z2, Z3 = (("zero", 2),), (("zero", 3),)
PARITY = [
    Scenario("gpt", dp=2, options=Z2 + (("bucket_size", 3000),)),
    Scenario("gpt", dp=2, options=Z3),
    Scenario("llama", dp=4, options=Z2),
    Scenario("gpt", dp=4, options=Z3),
    Scenario("gpt", dp=2, options=Z3 + (("bucket_size", 3000),)),  # and the same with:
    Scenario("gpt", dp=2, options=Z3 + (("bucket_size", 3000), ("backward_prefetch", "post"))),
    Scenario("gpt", dp=2, pp=2, schedule="1f1b", options=Z3),  # a tied embedding on both stages
    Scenario("gpt", dp=2, pp=2, schedule="1f1b", options=Z3 + (("reshard_after_forward", False),)),
    Scenario("llama", dp=2, pp=2, vpp=2, schedule="interleaved", options=Z3),
    Scenario("gpt", dp=2, tp=2, options=Z3),
    Scenario("llama", dp=2, cp=2, options=Z3),
    Scenario("gpt", dp=2, pp=2, schedule="zbh1", options=Z2),
    Scenario("llama", dp=4, options=Z3 + (("recompute", "full"),)),
    Scenario("gpt", dp=4, meta=True, options=Z3),
    Scenario("llama", dp=2, tp=2, meta=True, options=Z3),  # each rank makes its tp shard's dp part
    # experts over edp = 2, the rest over dp = 4
    Scenario("moe-mixtral", dp=4, options=(("ep", 2),) + Z2),
]
BF16 = [
    Scenario("llama", dp=2, options=Z3 + (("precision", "bf16"),)),
    # fp32 masters of shards made
    Scenario("llama", dp=2, options=Z3 + (("precision", "bf16"),), meta=True),
]
# Hugging Face models, not written for fxmeg's tests;
ZOO = [
    Scenario("hf-llama", dp=2, options=Z3),
    Scenario("hf-gpt2", dp=2, options=Z3),  # tied heads: read through ops.early_linear
    Scenario("hf-gemma2", dp=2, options=Z3),
]  # (Gemma 2's softcapped)
ROUTER = Scenario("hf-mixtral", dp=2, options=Z3)  # 3-D expert banks whole (ep=1), a router loss
SCENARIOS = PARITY + ZOO + [ROUTER] + BF16

MADE: list[dict[str, int]] = []
"""Each call of ``Source.values`` on this rank (a model built on meta): tensor -> elements made."""


def _counting(values):
    def counted(self, wanted, *args):
        out = values(self, wanted, *args)
        MADE.append({n: t.numel() for n, t in out.items()})
        return out

    return counted


def held(rank: int, engine) -> dict:
    """What this rank holds between steps, counted from the tensors: parameter bytes whose
    memory is allocated, gradient elements of every buffer, shard elements."""
    ctx, par = engine.context, engine.config.parallel
    # what the dense buffers and the expert banks' buffers shard over
    dp_cp, edp = par.dp_cp, par.edp
    return dict(
        param_bytes=sum(p.untyped_storage().nbytes() for p in ctx.named_parameters.values()),
        params=len(ctx.named_parameters),
        main_grads=sum(
            getattr(p, "main_grad", None) is not None for p in ctx.named_parameters.values()
        ),
        grad_elements=sum(b.reduced().numel() for b in ctx.ddp.all()),
        shard_elements=sum(
            b.param_shard.numel() for b in ctx.ddp.all() if hasattr(b, "param_shard")
        ),
        buffer_elements=sum(b.layout.numel for b in ctx.ddp.all()),
        share=sum(b.layout.numel // (edp if b.layout.experts else dp_cp) for b in ctx.ddp.all()),
        dp_cp=dp_cp,
        dp_cp_rank=ctx.groups.dp_cp_rank,
        buckets=sum(len(b.layout.buckets) for b in ctx.ddp.all()),
        made=[
            {name: n for name, n in call.items() if name in ctx.named_parameters} for call in MADE
        ],
        **(
            dict(pieces=master_pieces(engine), tp_rank=ctx.groups.tp_rank)
            if engine.config.precision == "bf16"
            else {}
        ),
    )


# Checkpoints: 2 steps under one layout, engine.save, then a new engine under the other
# layout loads it and trains steps 3-4; both against plain single-device training.
MOVES = {"zero3-dp4-to-zero1-tp2-dp2": (dict(zero=3), dict(zero=1, tp=2)),
         "zero1-tp2-dp2-to-zero3-dp4": (dict(zero=1, tp=2), dict(zero=3))}
MOVE_BATCHES = [make_batch(16, seed=40 + s) for s in range(4)]


def _engine(**layout):
    ids, labels = MOVE_BATCHES[0]
    return fxmeg.parallelize(
        make_model("gpt", n_layer=2),
        (ids[:2], labels[:2]),
        global_batch_size=16,
        optimizer=optimizer,
        **layout,
    )


def moves(root: str) -> dict:
    out = {}
    for name, (saved, loaded) in MOVES.items():
        first = _engine(**saved)
        losses = [first.train_step(b).loss for b in MOVE_BATCHES[:2]]
        before = first.full_state_dict()
        first.save(os.path.join(root, name)).wait()
        second = _engine(**loaded)
        second.load(os.path.join(root, name))
        after = second.full_state_dict()
        losses += [second.train_step(b).loss for b in MOVE_BATCHES[2:]]
        out[name] = dict(losses=losses, before=before, after=after, state=second.full_state_dict())
    return out


class _ViewBlock(nn.Module):
    """Reads its weights through views made before their last reader (``w.t()`` read by
    two matmuls, ``scale.view``): zero=3 must free them after the views' last reader."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, h):
        wt = self.w.t()
        a = torch.tanh(h @ wt)
        return h + (a @ wt) * self.scale.view(1, 1, -1)


class _Views(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_ViewBlock(dim) for _ in range(3))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for block in self.layers:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


VIEW_BATCHES = [make_batch(8, seed=60 + s) for s in range(3)]


def _view_model() -> _Views:
    torch.manual_seed(0)
    return _Views()


def views() -> dict:
    ids, labels = VIEW_BATCHES[0]
    engine = fxmeg.parallelize(
        _view_model(), (ids[:2], labels[:2]), global_batch_size=8, optimizer=optimizer, zero=3
    )
    losses = [engine.train_step(b).loss for b in VIEW_BATCHES]
    return dict(losses=losses, state=engine.full_state_dict())


def from_weights() -> dict:
    """dp=2, zero=3: a Llama built on meta reads its values from weights (a state dict)."""
    MADE.clear()
    ids, labels = VIEW_BATCHES[0]
    with torch.device("meta"):
        model = make_model("llama", n_layer=2)
    engine = fxmeg.parallelize(
        model,
        (ids[:2], labels[:2]),
        global_batch_size=8,
        optimizer=optimizer,
        zero=3,
        weights=make_model("llama", n_layer=2).state_dict(),
        # for its rotary table, not in a state dict
        init_fn=model.init_weights,
    )
    return dict(state=engine.full_state_dict(), **held(0, engine),
                param_elements=sum(p.numel() for p in engine.named_parameters.values()),
                layouts={c: engine.program.buffers[c] for c in engine.context.chunks})


def _read(fn) -> tuple[str, str]:
    """("ok", the value) or (the error's type, its message) of reading something."""
    try:
        return "ok", repr(fn())
    except Exception as e:  # noqa: BLE001 (compared by the test)
        return type(e).__name__, str(e)


def readme_reads() -> dict:
    """The README's train.py at dp=2 with zero=3, one step, then what a user reads of the
    module they passed (its parameters are views of memory freed between uses): a norm,
    state_dict(), a count of its elements; and of engine.named_parameters."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=32, n_layer=4, n_embd=64))
    tokens = torch.randint(0, 128, (32, 33))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    engine = fxmeg.parallelize(model, (ids[:4], labels[:4]), global_batch_size=32, zero=3,
                               optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-3))
    engine.train_step((ids, labels))
    return dict(norm=_read(lambda: model.wte.weight.norm()), state_dict=_read(model.state_dict),
                printed=_read(lambda: str(model.layers[0].mlp.fc.weight)),
                tied=_read(lambda: model.lm_head.weight + 1),
                elements=sum(p.numel() for p in model.parameters()),
                engine=_read(lambda: engine.named_parameters["wte.weight"].sum()),
                full=engine.full_state_dict()["wte.weight"].norm().item())


def run(rank: int, scenarios: list[Scenario], root: str) -> dict:
    Source.values = _counting(Source.values)
    out = {}
    for sc in scenarios:
        MADE.clear()
        out[sc.id] = train(rank, sc, held)
    if torch.distributed.get_world_size() == 4:
        out["moves"] = moves(root)
    else:
        out["views"] = views()
        out["weights"] = from_weights()
        out["readme"] = readme_reads()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero"))
    return {w: run_world(w, run, [s for s in SCENARIOS if s.world == w], root) for w in (2, 4)}


def _zero(sc: Scenario) -> int:
    return dict(sc.options)["zero"]


@pytest.mark.parametrize("sc", PARITY + ZOO, ids=lambda s: s.id)
def test_parity(results, sc):
    check_parity([r[sc.id] for r in results[sc.world]], sc)


def test_a_mixture_of_experts_with_its_router_loss(results):
    """Hugging Face Mixtral at zero=3: language-model and router loss as single-device training."""
    check_router_loss([r[ROUTER.id] for r in results[ROUTER.world]], ROUTER)


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.id)
def test_each_rank_holds_its_share_between_steps(results, sc):
    """Gradients (zero >= 2) and parameters (zero=3) held between steps are 1 / (dp x cp) of
    the stage's buffer (the experts' buffers: 1 / edp, the ranks holding the same experts),
    which is the stage's parameters plus padding; no whole gradient (main_grad) survives
    the step and, at zero=3, no parameter memory does."""
    for r in (r[sc.id] for r in results[sc.world]):
        share = r["share"]
        assert (
            r["buffer_elements"] - r["param_elements"]
            <= 128 * r["dp_cp"] * r["buckets"] + 64 * r["params"]
        )
        assert r["grad_elements"] == share and r["main_grads"] == 0
        if dict(sc.options).get("ep", 1) == 1:
            assert share * r["dp_cp"] == r["buffer_elements"]
        if _zero(sc) == 3:
            assert r["param_bytes"] == 0 and r["shard_elements"] == share
        else:
            assert r["param_bytes"] >= 4 * r["param_elements"]


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.id)
def test_the_optimizer_state_is_each_ranks_share_of_the_model(results, sc):
    """Masters, exp_avg and exp_avg_sq summed over the ranks that share them are the
    model's elements (scenarios.check_optimizer_share): no rank keeps state of a whole
    stage, none of the buffers' padding."""
    check_optimizer_share([r[sc.id] for r in results[sc.world]], sc)


def test_without_resharding_backward_needs_no_second_gather(results):
    """reshard_after_forward=False at pp=2 x dp=2 (1F1B): forward keeps what it gathered
    until backward has used it, so a step gathers fewer times than with the default,
    which frees each bucket after forward and gathers it again for backward."""
    kept = next(s for s in PARITY if ("reshard_after_forward", False) in s.options)
    freed = next(s for s in PARITY if s.options == Z3 and s.pp == 2 and s.schedule == "1f1b")
    for r in results[4]:
        fewer = [sum(k == "gather" for k, _ in log) for log in r[kept.id]["events"]]
        more = [sum(k == "gather" for k, _ in log) for log in r[freed.id]["events"]]
        assert all(0 < a < b for a, b in zip(fewer, more)), (fewer, more)


def test_zero3_gathers_before_use_and_frees_after(results):
    """dp=4, 6 buckets (one per block, embedding, head): in every step each bucket is
    gathered and freed, forward keeps at most the bucket it computes with and the one it
    prefetches, and nothing stays gathered when the step ends."""
    sc = next(s for s in PARITY if s.id == "gpt-dp4-pp1-vpp1-auto-m4-zero3")
    for r in results[sc.world]:
        assert r[sc.id]["buckets"] == 6
        for log in r[sc.id]["events"]:
            live, most, gathered = set(), 0, set()
            for kind, label in log:
                if kind == "gather":
                    live.add(label)
                    gathered.add(label)
                elif kind == "released":
                    assert label in live
                    live.discard(label)
                most = max(most, len(live))
            assert len(gathered) == 6 and not live and most <= 3


def test_zero3_frees_a_bucket_in_backward_once_autograd_let_go_of_it(results):
    """dp=4, the tied embedding's bucket (5): backward reads it first (the head's input
    gradient) and its gradient comes last (the embedding's). It is freed once autograd
    let go of the tensors it saved from it, not when its gradient arrives: no block's
    backward runs with it whole."""
    sc = next(s for s in PARITY if s.id == "gpt-dp4-pp1-vpp1-auto-m4-zero3")
    for r in results[sc.world]:
        for log in r[sc.id]["events"]:
            ready = [k for k, (kind, _) in enumerate(log) if kind == "ready"]
            last = log.index(("ready", "wte.weight"))
            live = set()
            for k, (kind, label) in enumerate(log[:last]):
                live = (
                    live | {label}
                    if kind == "gather"
                    else live - {label}
                    if kind == "released"
                    else live
                )
                assert k < ready[0] or "chunk0/5" not in live, log[k - 3 : k + 1]


def _most_whole_in_backward(log: list[tuple[str, str]]) -> int:
    """The most parameter buckets gathered plus gradient buckets staged at once inside the
    chunk's backward actions."""
    params, grads, most, inside = set(), set(), 0, False
    for kind, label in log:
        if kind in ("gather", "released"):
            params = params | {label} if kind == "gather" else params - {label}
        elif kind in ("staged", "settled"):
            grads = grads | {label} if kind == "staged" else grads - {label}
        elif kind == "backward":
            inside = label == "begin"
        if inside:
            most = max(most, len(params) + len(grads))
    return most


def test_backward_prefetch_post_keeps_one_bucket_of_each_whole(results):
    """dp=2, zero=3, 3000-element buckets: with backward_prefetch='post' backward holds at
    most one parameter bucket and one gradient bucket whole at once (it gathers the next
    bucket once it freed one, and waits for a reduction before it stages the next); with
    'pre' it holds up to four (the current and next parameters, a gradient bucket being
    reduced and the one being filled)."""
    pre, post = (next(s for s in PARITY if s.options == Z3 + (("bucket_size", 3000),) + extra)
                 for extra in ((), (("backward_prefetch", "post"),)))
    for r in results[2]:
        most_pre = [_most_whole_in_backward(log) for log in r[pre.id]["events"]]
        most_post = [_most_whole_in_backward(log) for log in r[post.id]["events"]]
        assert all(m <= 2 for m in most_post) and all(m == 4 for m in most_pre), (
            most_post,
            most_pre,
        )


@pytest.mark.parametrize("sc", BF16, ids=lambda s: s.id)
def test_bf16_zero3_trains_as_the_mixed_precision_oracle(results, sc):
    """Parameters gathered in bf16, gradients reduced in fp32, fp32 masters sharded (for a
    model built on meta, from the fp32 values of the shard each rank made): losses, norms
    and every master as the plain-PyTorch mixed-precision oracle's."""
    check_sharded_bf16([r[sc.id] for r in results[sc.world]], sc)


def must_make(layouts, parts: int, part: int) -> dict[str, int]:
    """Parameter -> elements a rank makes of it at zero=3 on meta, from the bucket
    layout's slots alone (not fxmeg's ZeroBuffer): a rank makes a parameter (its local,
    tensor-parallel shard, whole) iff some element of it lies in the rank's equal part
    (``part`` of ``parts``) of its bucket."""
    out = {}
    for layout in layouts:
        for b in layout.buckets:
            size = (b.end - b.start) // parts
            lo, hi = b.start + part * size, b.start + (part + 1) * size
            out |= {s.name: s.numel for s in layout.slots
                    if s.bucket == b.index and s.offset < hi and lo < s.offset + s.numel}
    return out


@pytest.mark.parametrize("case", [s.id for s in SCENARIOS if s.meta] + ["weights"])
def test_zero3_on_meta_makes_exactly_the_parameters_its_shard_covers(results, case):
    """Built on meta at zero=3, from init_fn or from weights: each rank makes (or reads)
    exactly the parameters its parts of the buckets cover (``must_make``), each once, and
    none other: never the whole stage; and the values are the model's."""
    world = 2 if case == "weights" else next(s.world for s in SCENARIOS if s.id == case)
    if case == "weights":
        assert_bitwise(
            results[2][0]["weights"]["state"], make_model("llama", n_layer=2).state_dict()
        )
    for r in (r[case] for r in results[world]):
        made = {}
        for call in r["made"]:  # a call of the source a bucket
            assert not made.keys() & call.keys(), f"made twice: {sorted(made.keys() & call.keys())}"
            made |= call
        want = must_make(
            [lay for lays in r["layouts"].values() for lay in lays], r["dp_cp"], r["dp_cp_rank"]
        )
        assert made == want, f"made but not covered {sorted(made.keys() - want.keys())}, " \
                             f"covered but not made {sorted(want.keys() - made.keys())}"
        assert 0 < sum(made.values()) < r["param_elements"]


@pytest.mark.parametrize("move", list(MOVES))
def test_checkpoint_moves_between_zero3_and_zero1(results, move):
    """Saved at one layout, loaded at the other: the loaded state is the saved one exactly,
    and the four steps are single-device training's."""
    got = results[4][0]["moves"][move]
    assert_bitwise(got["after"], got["before"])
    want_losses, _, want_state = plain_reference(make_model("gpt", n_layer=2), MOVE_BATCHES)
    assert_losses_close(got["losses"], want_losses)
    assert_weights_close(got["state"], want_state)


def test_reading_the_users_module_after_zero3_is_a_named_error(results):
    """After parallelize(zero=3) the user's module holds placeholders, not views of freed
    memory (reading those was a segfault): a norm, state_dict() and printing a weight raise
    ReleasedError naming the parameter and engine.full_state_dict(); shapes still count the
    model; full_state_dict() reads it."""
    for r in (r["readme"] for r in results[2]):
        for what in ("norm", "state_dict", "printed", "engine", "tied"):
            kind, message = r[what]
            assert (
                kind == "ReleasedError" and "full_state_dict()" in message and "zero=3" in message
            ), r[what]
        assert "'wte.weight' (tied: 'lm_head.weight')" in r["norm"][1] == r["tied"][1]
        assert "'layers.0.mlp.fc.weight'" in r["printed"][1]
        assert r["elements"] == sum(
            p.numel()
            for p in GPT(GPTConfig(vocab_size=128, seq_len=32, n_layer=4, n_embd=64)).parameters()
        )
        assert r["full"] > 0


def test_zero3_frees_a_parameter_after_the_last_reader_of_its_views(results):
    """dp=2: weights read through ``w.t()`` twice and ``scale.view``: trains as one device
    (a bucket freed before a view's last reader fails: its memory is not allocated)."""
    want_losses, _, want_state = plain_reference(_view_model(), VIEW_BATCHES)
    for r in results[2]:
        assert_losses_close(r["views"]["losses"], want_losses)
    assert_weights_close(results[2][0]["views"]["state"], want_state)


@pytest.mark.parametrize(
    "sc",
    [s for s in PARITY if s.pp == 1 and s.tp == 1 and s.cp == 1 and not s.meta][:4],
    ids=lambda s: s.id,
)
def test_the_plan_counts_what_a_rank_holds(results, sc):
    """``fxmeg.plan`` (no process) predicts the gradient and parameter bytes each rank
    holds between steps at zero=2 and 3, as counted on the ranks."""
    ids, labels = sc.batches()[0]
    options = {k: v for k, v in sc.options}
    stage = fxmeg.plan(
        sc.make_model(), (ids[:MBS], labels[:MBS]), dp=sc.dp, global_batch_size=sc.gbs, **options
    ).stages[0]
    r = results[sc.world][0][sc.id]
    assert stage.gradient_buffers == 4 * r["grad_elements"]
    assert stage.parameters == 4 * (r["shard_elements"] if _zero(sc) == 3 else r["param_elements"])
    assert stage.buckets_in_flight > 0 and stage.total > stage.weights_and_optimizer
