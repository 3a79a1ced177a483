"""Parity scenarios shared by the multi-process test modules: what each rank trains,
what it reports, and the comparison with plain single-device PyTorch."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field

import torch

import fxmeg
from fxmeg.ir.layouts import Shard
from fxmeg.weights.sources import open_weights
from tests.harness.helpers import (
    OPTIMIZERS,
    Run,
    assert_bitwise,
    assert_grads_close,
    assert_losses_close,
    assert_weights_close,
    digests,
    make_batch,
    make_optimizers,
    optimizer,
    reference_groups,
    reference_run,
    replica_failures,
    seeded_init,
)
from tests.harness.judge import Judge
from tests.harness.models import make_model

MBS, STEPS = 2, 5


@dataclass(frozen=True)
class Scenario:
    model: str
    pp: int = 1
    vpp: int = 1
    schedule: str = "auto"
    m: int = 4
    dp: int = 1
    tp: int = 1
    cp: int = 1
    clip: float = 1.0
    opt: str = "adamw"
    options: tuple = field(default=())
    """Extra parallelize() keyword arguments, as (name, value) pairs."""
    model_args: tuple = field(default=())
    """Extra model (config) arguments, as (name, value) pairs."""
    meta: bool = False
    """Build the model on the meta device: parallelize makes each rank's part
    (init_fn=model.init_weights, seed=0; a Hugging Face model's own ``_init_weights``,
    fxmeg's default) and the reference trains its twin, initialised by the test's own
    statement of the seeding rule (``tests.harness.helpers.seeded_init``)."""
    pretrained: bool = False
    """Build the model on meta and load it with weights= the ``save_pretrained`` directory of
    ``make_model()`` (``saved_at(root)``, written by ``save_pretrained(root)`` before the
    spawn); the reference trains the in-memory model."""

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def layers(self) -> int:
        return max(4, self.pp * self.vpp)

    @property
    def gbs(self) -> int:
        return MBS * self.m * self.dp

    @property
    def id(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in self.options + self.model_args)
        clip = "" if self.clip == 1.0 else f"-clip{self.clip}"
        opt = "" if self.opt == "adamw" else f"-{self.opt}"
        tp = f"tp{self.tp}-" if self.tp > 1 else ""
        tp += f"cp{self.cp}-" if self.cp > 1 else ""
        return (f"{self.model}-{tp}dp{self.dp}-pp{self.pp}-vpp{self.vpp}-{self.schedule}-m{self.m}"
                + clip + opt + extra + ("-meta" if self.meta else "")
                + ("-pretrained" if self.pretrained else ""))

    @property
    def hugging_face(self) -> bool:
        return self.model.startswith(("hf-", "moe-"))

    def make_model(self):
        """The single-device model (for a meta scenario: its twin, as ``seeded_init``
        initialises it, not as fxmeg.materialize does)."""
        model = make_model(self.model, n_layer=self.layers, **dict(self.model_args))
        if not self.meta:
            return model
        return seeded_init(model, model._init_weights if self.hugging_face else model.init_weights,
                           0)

    def saved_at(self, root: str) -> str:
        return os.path.join(root, "pretrained", self.id)

    def save_pretrained(self, root: str) -> None:
        """A pretrained scenario's checkpoint, in the Hugging Face format transformers
        writes (its own names: a Mixtral's experts one tensor each)."""
        self.make_model().save_pretrained(self.saved_at(root))

    def meta_model(self):
        with torch.device("meta"):
            return make_model(self.model, n_layer=self.layers, **dict(self.model_args))

    def batches(self):
        return [make_batch(self.gbs, seed=100 + s) for s in range(STEPS)]

    def engine(self, weights=None, model=None):
        """fxmeg's engine of this scenario (``weights``: ``open_weights(saved_at(root))``, if
        pretrained), of ``model`` (default: a new one; a test that reads the user's module
        after parallelize passes its own)."""
        batches = self.batches()
        if model is None:
            model = self.meta_model() if self.meta or self.pretrained else self.make_model()
        init = {}
        if self.meta:
            init = dict(seed=0) if self.hugging_face else dict(init_fn=model.init_weights, seed=0)
        if self.pretrained:
            assert weights is not None, f"{self.id}: pretrained needs the weights it saved"
            init = dict(weights=weights)
        return fxmeg.parallelize(
            model,
            tuple(t[:MBS] for t in batches[0]),
            **init,
            tp=self.tp,
            cp=self.cp,
            pp=self.pp,
            vpp=self.vpp,
            schedule=self.schedule,
            global_batch_size=self.gbs,
            optimizer=OPTIMIZERS[self.opt],
            clip_grad=self.clip,
            **dict(self.options),
        )


def train(rank: int, sc: Scenario, extra=None, root: str | None = None, *, model=None) -> dict:
    """Train one scenario (of ``model``, default a new one) on this rank; report what the
    tests compare (and what ``extra(rank, engine)`` returns, after training). ``root``:
    where pretrained scenarios were saved (``read``: the checkpoint tensors this rank read)."""
    weights = open_weights(sc.saved_at(root)) if sc.pretrained else None
    engine = sc.engine(weights, model)
    initial = engine.full_state_dict() if sc.meta else None  # collective: every rank calls it
    steps, counters, events, grads, grad_digests = [], [], [], [], []
    for b in sc.batches():
        step = engine.train_step(b, full_grads=True)  # collective: every rank gathers them
        steps.append(dataclasses.replace(step, grads=None))
        grads.append(step.grads if rank == 0 else None)
        grad_digests.append(digests(step.grads))
        counters.append(engine.context.executor.counters)
        events.append(list(engine.context.ddp.events.log))
    state = engine.full_state_dict()  # collective: every rank calls it
    return dict(
        optimizer_elements=engine.context.optimizer.state_elements(),
        steps=steps, counters=counters, events=events, grads=grads,
        state=state if rank == 0 else None, grad_digests=grad_digests, state_digests=digests(state),
        initial=initial if rank == 0 else None,
        pp_rank=engine.context.groups.pp_rank, dp_rank=engine.context.groups.dp_rank,
        tp_rank=engine.context.groups.tp_rank, param_names=sorted(engine.named_parameters),
        param_elements=sum(p.numel() for p in engine.named_parameters.values()),
        tp_specs=engine.program.tp_specs,
        layouts={c: engine.program.buffers[c] for c in engine.context.chunks},
        read=sorted(weights.reads) if weights is not None else None,
        ep_rank=engine.context.groups.ep_rank,
    ) | (extra(rank, engine) if extra is not None else {})  # an extra may repeat a key (tp_rank)


def train_each(rank: int, scenarios: list[Scenario]) -> dict:
    """Every scenario of one spawn on this rank, by id (``run_worlds``' usual ``fn``)."""
    return {sc.id: train(rank, sc) for sc in scenarios}


def check_parity(ranks: list[dict], sc: Scenario, *, norm_rtol: float = 1e-4,
                 model: torch.nn.Module | None = None) -> None:
    """Every rank reports the same step results, equal to single-device training of
    ``model`` (default: ``sc.make_model()``): losses, grad norms, every parameter's
    gradient at every step and the final weights; every rank's copies of them equal rank
    0's (``replica_failures``)."""
    model = model if model is not None else sc.make_model()
    failure = replica_failures(ranks)
    assert failure is None, failure
    ref = reference_run(model, sc.batches(), clip=sc.clip, opt=sc.opt)
    for r in ranks:
        assert [s.loss for s in r["steps"]] == [s.loss for s in ranks[0]["steps"]]
        assert [s.grad_norm for s in r["steps"]] == [s.grad_norm for s in ranks[0]["steps"]]
    steps = ranks[0]["steps"]
    assert_losses_close([s.loss for s in steps], ref.losses)
    assert_losses_close([s.grad_norm for s in steps], ref.norms, rtol=norm_rtol)
    assert_grads_close(ranks[0]["grads"], ref)
    assert_weights_close(ranks[0]["state"], ref.state)
    if sc.meta:  # each rank made its part exactly as the single-device twin
        assert_bitwise(ranks[0]["initial"], sc.make_model().state_dict())


def check_optimizer_share(ranks: list[dict], sc: Scenario) -> None:
    """The optimizer state each rank keeps (``Optimizer.state_elements``: fp32 masters,
    AdamW's exp_avg and exp_avg_sq) is its share of the model, counted from the plain
    single-device model's parameters, not from fxmeg's buffer layouts:
      * a rank holds the parameters it reports (its pipeline stage's), a tp-split one as
        numel / tp, an expert bank (``.experts.``, [E, ...]) as its E / ep experts; over
        all ranks every parameter of the model is held;
      * without the distributed optimizer each rank keeps state of exactly what it holds;
      * with it (zero >= 1) the ranks of one (pipeline, tp) coordinate split the state:
        dense parameters over their dp x cp ranks, banks over the expert-data-parallel
        ranks (dp x cp / ep), so their states sum to the dense parameters one of them
        holds plus the banks of all of them, each divided by its sharers; at pp = tp = 1
        exactly the model's element count.
    No padding is allowed: the buffers pad each bucket to a multiple of the ranks sharing
    it, but padding belongs to no parameter, so no master or moment covers it (Megatron's
    distributed optimizer keeps state of its parameters' ranges only)."""
    model = sc.make_model()
    plain = {
        n: p.numel() for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
    }
    assert {n for n, p in model.named_parameters() if p.requires_grad} <= {
        n for r in ranks for n in r["param_names"]
    }
    options = dict(sc.options)
    ep, dp_cp = options.get("ep", 1), sc.dp * sc.cp
    shared = options.get("zero", 0) >= 1 or options.get("distributed_optimizer", False)
    coordinates: dict[tuple[int, int], list[dict]] = {}
    for r in ranks:
        coordinates.setdefault((r["pp_rank"], r["tp_rank"]), []).append(r)
    for where, members in coordinates.items():
        held = [_held_elements(r, plain, sc.tp, ep) for r in members]
        if not shared:
            wants = [dense + banks for dense, banks in held]
            gots = [r["optimizer_elements"] for r in members]
        else:
            dense, banks = sum(d for d, _ in held), sum(b for _, b in held)
            assert dense % dp_cp == 0 and banks % (dp_cp // ep) == 0, (where, dense, banks)
            wants = [dense // dp_cp + banks // (dp_cp // ep)]
            keys = members[0]["optimizer_elements"]
            gots = [{key: sum(r["optimizer_elements"][key] for r in members) for key in keys}]
            if sc.pp == sc.tp == 1:
                assert wants == [sum(p.numel() for p in model.parameters() if p.requires_grad)], (
                    wants,
                    where,
                )
        for got, want in zip(gots, wants, strict=True):
            assert got == dict.fromkeys(("master", "exp_avg", "exp_avg_sq"), want), (
                f"(pp, tp) rank {where}: {got}, the model's share {want} each")


def _held_elements(rank: dict, plain: dict[str, int], tp: int, ep: int) -> tuple[int, int]:
    """(dense elements, expert-bank elements) of the parameters ``rank`` holds, from the
    plain model's sizes: a tp-split parameter's 1 / tp, a bank's E / ep experts."""
    dense = banks = 0
    for name in rank["param_names"]:
        split = isinstance(rank["tp_specs"].get(name), Shard)
        if ".experts." in name:  # E / ep experts, split over tp under expert tp
            assert plain[name] % ep == 0, name
            banks += plain[name] // ep // (tp if split else 1)
        else:
            dense += plain[name] // tp if split else plain[name]
    return dense, banks


def check_router_loss(ranks: list[dict], sc: Scenario) -> None:
    """Parity of a Mixtral trained with its router loss (``router_loss_reference``):
    losses, grad norms, every step's gradients and the final weights."""
    failure = replica_failures(ranks)
    assert failure is None, failure
    ref = router_loss_reference(sc)
    steps = ranks[0]["steps"]
    assert_losses_close([s.loss for s in steps], ref.losses)
    assert_losses_close([s.grad_norm for s in steps], ref.norms, rtol=1e-4)
    assert_grads_close(ranks[0]["grads"], ref)
    assert_weights_close(ranks[0]["state"], ref.state)


def router_loss_reference(sc: Scenario) -> Run:
    """Single-device training of a Mixtral with its router loss: token-weighted
    cross-entropy over the global batch plus each micro-batch's router loss weighted
    1 / (the global batch's micro-batches, m * dp), as Megatron's MoEAuxLossAutoScaler
    averaged over data-parallel ranks. With moe_router_load_balancing_type
    "global_aux_loss" the router loss's tokens per expert are their mean over the
    micro-batches run so far on every dp rank (micro-batch g of the global batch is the
    g // dp-th of its rank), written out here from the router logits (Switch's loss:
    E * sum_e f_e * P_e, checked against the model's own per micro-batch). Its judge of
    rounding replays it (in float64 with eager experts; rows reordered within each
    micro-batch, which leaves each micro-batch's router loss as it is)."""
    model = make_model(sc.model, n_layer=sc.layers)

    def again(batches, factory=None, dtype=None) -> Run:
        if dtype is None:
            return _router_loss_run(model, sc, batches, factory or optimizer)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            cast = copy.deepcopy(model)
            if cast._can_set_experts_implementation():
                cast.set_experts_implementation("eager")  # torch._grouped_mm has no float64
            return _router_loss_run(cast.to(dtype), sc, batches, factory or optimizer)
        finally:
            torch.set_default_dtype(default)

    run = again(sc.batches())
    return dataclasses.replace(
        run, judge=Judge(again, sc.batches(), run.weights, micro_batch_size=MBS))


def _router_loss_run(model, sc: Scenario, batches, factory) -> Run:
    coef, experts, k = (
        model.config.router_aux_loss_coef,
        model.config.num_local_experts,
        model.config.num_experts_per_tok,
    )
    running = dict(sc.options).get("moe_router_load_balancing_type") == "global_aux_loss"
    ref = copy.deepcopy(model)
    opts = make_optimizers(factory, reference_groups(ref.named_parameters()))
    losses, norms, grads, weights = [], [], [], []
    for ids, labels in batches:
        for o in opts:
            o.zero_grad()
        weights.append({n: p.detach().clone() for n, p in ref.named_parameters()})
        total = int((labels[:, 1:] != -100).sum())
        micro_batches = len(ids) // MBS  # m on each of dp ranks
        parts = [slice(g * MBS, (g + 1) * MBS) for g in range(micro_batches)]
        with torch.no_grad():
            fractions = [
                _switch_terms(ref(input_ids=ids[p], use_cache=False), experts, k)[0] for p in parts
            ]
        ce_sum = 0.0
        for g, part in enumerate(parts):
            out = ref(input_ids=ids[part], labels=labels[part], use_cache=False)
            n = int((labels[part, 1:] != -100).sum())
            ce = out.loss - coef * out.aux_loss
            f, probs = _switch_terms(out, experts, k)
            # the model's own loss
            torch.testing.assert_close(experts * (f * probs).sum(), out.aux_loss)
            if running:
                f = torch.stack(fractions[: (g // sc.dp + 1) * sc.dp]).mean(0)
            aux = experts * (f.detach() * probs).sum()
            (ce * n / total + coef * aux / micro_batches).backward()
            ce_sum += ce.item() * n
        grads.append(
            {
                n: p.grad.detach().clone()
                for n, p in ref.named_parameters(remove_duplicate=False)
                if p.grad is not None
            }
        )  # before clipping
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        for o in opts:
            o.step()
        losses.append(ce_sum / total)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return Run(losses, norms, state, grads, weights)


def _switch_terms(out, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, P) of a Mixtral forward's router logits, all layers' tokens together: each
    expert's share of the routed (token, slot) pairs per token, and its mean probability."""
    logits = torch.cat(out.router_logits, 0)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays
    probs = torch.softmax(logits, -1)
    chosen = torch.topk(probs, k, -1).indices
    f = torch.nn.functional.one_hot(chosen, experts).float().sum((0, 1)) / logits.shape[0]
    return f, probs.mean(0)
