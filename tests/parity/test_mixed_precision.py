"""bf16 and fp16 on real gloo ranks vs the plain-PyTorch mixed-precision oracle
(tests/parity/mixed_precision.py), issue 16: for dp, tp, tp with sequence parallelism,
1F1B, interleaved 1F1B, tp x pp x dp with the distributed optimizer and dp with it, cp2 under
the ring (cp_comm_type p2p: issue 48),
Llama (untied, 4 layers, hidden 32), 10 steps:
  * every step's loss within 2e-3 (relative) of the oracle's, the same steps skipped and
    the same loss scales (fp16: a dynamic scale that grows, then overflows and backs off);
  * every fp32 master within 1e-5 (relative norm) of the oracle's, gathered from every
    rank's optimizer pieces, for the layouts without tensor parallelism: their arithmetic
    is the oracle's up to the order of fp32 sums (they agree to 4.1e-9, pipelines bitwise);
  * with tensor or context parallelism (whose ring merges its blocks' attention in fp32) the
    half-precision partial sums of row-parallel layers are
    rounded and reduced across tp ranks (as in Megatron), a different rounding than one
    device's, and Adam amplifies it: the masters land up to 7.2e-3 (bf16) / 3.6e-3
    (fp16) from the oracle's on one parameter (v_proj), 9.4e-4 / 2.7e-4 over all of them,
    about as far as the oracle itself is from float64 (9.1e-4 to 1.1e-3 / 1.2e-4 to
    2.2e-4). There the developers' rule applies instead: the masters, all parameters
    together, are no farther from a float64 run of the same training (same skipped steps)
    than the oracle's, within FLOAT64_SLACK. Measured ratios: 0.70 to 1.30 here, 0.70 to
    1.40 with another model and data seed; stepping the half-precision parameters
    directly gives 3.8 to 4.3 (bf16). All together, one parameter's error is diluted
    among the others, so each parameter is held to the rule too, by its gradient at every
    step (mixed_precision.float64_grad_failures, within PARAM_SLACK; a gradient that is
    zero is about 100 x the oracle's). Its masters after 10 steps are a noisier judge: an
    element whose gradient is within rounding of zero may take Adam's first step the other
    way (measured 0.16 to 3.0 x the oracle's, of their change, in one window; 4.2 x on
    v_proj of fp16 tp2 x pp2 x dp2 on another machine, at the commit that measured 3.0,
    where every step's gradients were within the rule).
  * pipeline-only layouts are bitwise the same engine at world size 1;
  * masters start from the user's fp32 values, and at tp2 x dp2 each rank keeps masters
    of exactly the elements it updates.

One spawn per world size (2, 4, 8) runs every scenario of that size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import fxmeg
from fxmeg.loss_scale import LossScaleConfig
from tests.harness.distributed import run_worlds
from tests.harness.helpers import OPTIMIZERS, assert_bitwise, dp_shard_elements, make_batch
from tests.parity.mixed_precision import (
    float64_grad_failures,
    gather_masters,
    master_pieces,
    masters_failure,
    reference,
)
from tests.parity.scenarios import MBS, Scenario

STEPS = 10
LOSS_RTOL = 2e-3
MASTER_RTOL = 1e-5
FLOAT64_SLACK = 1.5
"""With tp: |masters - float64| <= FLOAT64_SLACK x |oracle - float64| (all parameters
together), and for each parameter PARAM_SLACK x the oracle's (mixed_precision.change_errors)."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp16: gradients of this model overflow at a scale of 2**14 and not at 2**13 (on these
# batches), so the scale grows after 3 clean steps and the next step is skipped.
LOSS_SCALE = LossScaleConfig(initial=2.0**13, growth_interval=3, hysteresis=1)
DISTOPT = (("distributed_optimizer", True),)
CLIP = 0.5  # below every step's norm (0.78 to 1.29): clipping is active
LAYOUTS = {  # pipeline-only layouts without clipping: the bitwise comparison needs it off
    "dp2": dict(dp=2, clip=CLIP),
    "tp2": dict(tp=2, clip=CLIP),
    "tp2-sp": dict(tp=2, clip=CLIP, options=(("sequence_parallel", True),)),
    "pp2-1f1b": dict(pp=2, schedule="1f1b", clip=0.0),
    "pp2-vpp2": dict(pp=2, vpp=2, schedule="interleaved", clip=0.0),
    "tp2-pp2-dp2-distopt": dict(tp=2, pp=2, dp=2, schedule="1f1b", clip=CLIP, options=DISTOPT),
    "dp2-distopt": dict(dp=2, clip=CLIP, options=DISTOPT),
    # blocks of attention merged in fp32 (the ring; a2a runs SDPA as one device does)
    "cp2-p2p": dict(cp=2, clip=CLIP, options=(("cp_comm_type", "p2p"),)),
}


@dataclass(frozen=True)
class Mixed(Scenario):
    precision: str = "bf16"
    name: str = ""

    @property
    def id(self) -> str:
        return f"{self.precision}-{self.name}"

    def batches(self):
        return [make_batch(self.gbs, seed=100 + s) for s in range(STEPS)]

    def engine(self):
        extra = {"loss_scale": LOSS_SCALE} if self.precision == "fp16" else {}
        return fxmeg.parallelize(
            self.make_model(), tuple(t[:MBS] for t in self.batches()[0]), tp=self.tp, cp=self.cp,
            pp=self.pp,
            vpp=self.vpp, schedule=self.schedule, global_batch_size=self.gbs,
            optimizer=OPTIMIZERS[self.opt], clip_grad=self.clip, precision=self.precision,
            **extra, **dict(self.options),
        )


MATRIX = [Mixed("llama", precision=p, name=n, **kw) for p in DTYPES for n, kw in LAYOUTS.items()]
BITWISE = [sc for sc in MATRIX if sc.tp == sc.dp == sc.cp == 1]
COUNT = [  # built, not trained
    Mixed("llama", tp=2, dp=2, name="tp2-dp2"),
    Mixed("llama", tp=2, dp=2, name="tp2-dp2-distopt", options=DISTOPT),
]
SCENARIOS = MATRIX + COUNT


def train(rank: int, sc: Mixed, steps: int) -> dict:
    engine = sc.engine()
    scaler = engine.context.scaler
    first = master_pieces(engine)
    results, scales, grads = [], [], []
    for batch in sc.batches()[:steps]:
        scales.append(scaler.scale if scaler is not None else 1.0)
        # collective: every rank gathers them
        step = engine.train_step(batch, full_grads=sc.tp > 1 or sc.cp > 1)
        results.append(dataclasses.replace(step, grads=None))
        grads.append(step.grads if rank == 0 else None)
    state = engine.full_state_dict() if steps else None
    groups = engine.context.groups
    return dict(
        steps=results, grads=grads, scales=scales, first=first, pieces=master_pieces(engine),
        state=state if rank == 0 else None, tp_rank=groups.tp_rank, dp_rank=groups.dp_rank,
        tp_specs=engine.program.tp_specs,
        masters=engine.context.optimizer.state_elements()["master"],
        params={n: p.numel() for n, p in engine.named_parameters.items()},
        layouts={c: engine.program.buffers[c] for c in engine.context.chunks},
    )


def run(rank: int, scenarios: list[Mixed]) -> dict:
    return {sc.id: train(rank, sc, 0 if sc in COUNT else STEPS) for sc in scenarios}


@pytest.fixture(scope="module")
def results():
    return run_worlds(run, SCENARIOS, (2, 4, 8))


_REFERENCES: dict = {}


def oracle(sc: Mixed, float64: bool = False) -> dict:
    """The oracle's run of ``sc``, or with ``float64`` plain float64 training that skips
    the steps the oracle skipped (cached: several tests read them)."""
    key = (sc.layers, sc.gbs, sc.clip, sc.precision, float64)
    if key not in _REFERENCES:
        skips = oracle(sc)["skipped"] if float64 else None
        _REFERENCES[key] = reference(
            sc.make_model(), sc.batches(), dtype=torch.float64 if float64 else DTYPES[sc.precision],
            micro_batch_size=MBS, clip=sc.clip, loss_scale=LOSS_SCALE, skips=skips)
    return _REFERENCES[key]


def masters_of(ranks: list[dict], sc: Mixed, which: str = "pieces") -> dict[str, torch.Tensor]:
    shapes = {n: p.shape for n, p in sc.make_model().named_parameters()}
    return gather_masters([dict(r[sc.id], pieces=r[sc.id][which]) for r in ranks], shapes, sc.tp)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("sc", MATRIX, ids=lambda s: s.id)
def test_matches_the_mixed_precision_oracle(results, sc):
    ranks = results[sc.world]
    ref = oracle(sc)
    steps = ranks[0][sc.id]["steps"]
    for r in ranks:  # every rank reports the same step
        assert [(s.loss, s.grad_norm, s.skipped) for s in r[sc.id]["steps"]] == [
            (s.loss, s.grad_norm, s.skipped) for s in steps]
    assert [s.skipped for s in steps] == ref["skipped"]
    assert ranks[0][sc.id]["scales"] == ref["scales"]
    for step, (got, want) in enumerate(zip(steps, ref["losses"])):
        assert abs(got.loss - want) <= LOSS_RTOL * want, f"step {step}: {got.loss} vs oracle {want}"
    masters = masters_of(ranks, sc)
    assert masters.keys() == ref["masters"].keys()
    state = ranks[0][sc.id]["state"]  # the half-precision parameters are the masters, rounded
    for n, m in masters.items():
        assert torch.equal(state[n], m.to(state[n].dtype)), n
    if sc.tp == sc.cp == 1:
        errors = {n: relative(masters[n], w) for n, w in ref["masters"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= MASTER_RTOL, f"master {worst}: relative error {errors[worst]:.2e}"
        return
    exact = oracle(sc, float64=True)  # the developers' rule (module docstring)
    failures = masters_failure(masters, ref, exact, FLOAT64_SLACK) or float64_grad_failures(
        ranks[0][sc.id]["grads"], ref)  # each parameter, each step
    assert failures is None, failures


def _flat(masters: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([masters[n].double().flatten() for n in sorted(masters)])


def test_fp16_loss_scale_grows_and_skips():
    """The matrix's fp16 runs exercise both halves of the dynamic scale (per the oracle,
    which every fp16 case matches step by step: skips and scales)."""
    for sc in MATRIX:
        if sc.precision == "fp16":
            ref = oracle(sc)
            assert 0 < sum(ref["skipped"]) <= 3, sc.id
            assert any(b > a for a, b in zip(ref["scales"], ref["scales"][1:])), sc.id  # grew
            assert any(b < a for a, b in zip(ref["scales"], ref["scales"][1:])), sc.id  # backed off


def test_clipping_is_active():
    for sc in MATRIX:
        if sc.clip > 0:
            assert min(n for n in oracle(sc)["norms"] if n is not None) > sc.clip, sc.id


@pytest.mark.parametrize("sc", MATRIX + COUNT, ids=lambda s: s.id)
def test_masters_start_from_the_fp32_values(results, sc):
    """Item 1: each rank's masters are the user's fp32 values, not the rounded half ones."""
    masters = masters_of(results[sc.world], sc, "first")
    for n, p in sc.make_model().named_parameters():
        assert torch.equal(masters[n], p.detach()), n


_SINGLE: dict = {}


def single_rank(precision: str, clip: float) -> dict:
    """The same engine at world size 1 (no process group), trained like the matrix."""
    if (precision, clip) not in _SINGLE:
        sc = Mixed("llama", clip=clip, precision=precision, name="single")
        engine = sc.engine()
        steps = [engine.train_step(b) for b in sc.batches()]
        rank = dict(pieces=master_pieces(engine), tp_rank=0, tp_specs=engine.program.tp_specs)
        shapes = {n: p.shape for n, p in engine.named_parameters.items()}
        _SINGLE[precision, clip] = dict(steps=steps, state=engine.full_state_dict(),
                                        masters=gather_masters([rank], shapes, 1))
    return _SINGLE[precision, clip]


@pytest.mark.parametrize("sc", BITWISE, ids=lambda s: s.id)
def test_pipeline_is_bitwise_the_single_rank_engine(results, sc):
    """Llama (untied), clipping off: pp=2, with or without interleaving, does the
    arithmetic of the same engine at world size 1, half-precision and fp32 masters alike."""
    want = single_rank(sc.precision, sc.clip)
    ranks = results[sc.world]
    got = ranks[0][sc.id]["steps"]
    assert [(s.loss, s.skipped) for s in got] == [(s.loss, s.skipped) for s in want["steps"]]
    assert_bitwise(ranks[0][sc.id]["state"], want["state"])
    assert_bitwise(masters_of(ranks, sc), want["masters"])


@pytest.mark.parametrize("sc", COUNT, ids=lambda s: s.id)
def test_each_rank_keeps_masters_of_what_it_updates_only(results, sc):
    """Acceptance of issue 16: at tp2 x dp2 bf16 a rank's fp32 master elements are those
    it updates: its tp shards whole without the distributed optimizer, with it its dp
    shard of every bucket, from the layout; never a parameter the rank does not hold."""
    distributed = dict(sc.options).get("distributed_optimizer", False)
    ranks = [r[sc.id] for r in results[sc.world]]
    for r in ranks:
        assert {name for name, *_ in r["pieces"]} <= set(r["params"])
        if not distributed:
            assert r["masters"] == sum(r["params"].values())
            continue
        shard = sum(dp_shard_elements(lay, sc.dp, r["dp_rank"]) for lay in r["layouts"].values())
        assert r["masters"] == shard
    if distributed:  # the dp ranks' shards partition each tp rank's parameters exactly once
        held = sum(sum(r["params"].values()) for r in ranks)
        assert sum(r["masters"] for r in ranks) == held // sc.dp
