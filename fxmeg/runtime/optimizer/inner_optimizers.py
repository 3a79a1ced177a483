"""The inner optimizers: the factories fxmeg offers (``param_groups``, ``adamw``,
``muon_adamw``), what a factory builds, learnt on stand-ins (``OptimizerPlan``), and several
inner optimizers used as one (``Optimizers``). ``fxmeg.runtime.optimizer.optimizer`` wraps them with
masters, clipping and the distributed update, and re-exports this module's public names.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from fxmeg.errors import ConfigError
from fxmeg.sharding_modes import OptimizerSharding, decide_sharding

OptimizerFactory = Callable[[list[dict]], "torch.optim.Optimizer | Sequence[torch.optim.Optimizer]"]


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """Megatron's default groups: weight decay for matrices, none for 1-D parameters
    (biases, norm weights); ``wd_mult`` tells a weight-decay schedule which groups it
    drives; ``param_names`` (torch's optional group key) names each parameter. A factory
    that wants one group can flatten them:
    ``lambda groups: AdamW([p for g in groups for p in g["params"]])``."""
    decay, no_decay = ([], []), ([], [])
    for name, p in named:
        if p.requires_grad:
            names, params = no_decay if p.dim() <= 1 else decay
            names.append(name)
            params.append(p)
    groups = [
        {"params": decay[1], "param_names": decay[0], "wd_mult": 1.0},
        {"params": no_decay[1], "param_names": no_decay[0], "weight_decay": 0.0, "wd_mult": 0.0},
    ]
    return [g for g in groups if g["params"]]


def adamw(groups: list[dict], **kwargs) -> torch.optim.Optimizer:
    """AdamW as one fused kernel over all tensors on CPU and CUDA (7x faster than the
    per-tensor loop on CPU for a small GPT), else the multi-tensor (foreach) path."""
    devices = {p.device.type for g in groups for p in g["params"]}
    if devices <= {"cpu", "cuda"}:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def default_optimizer(groups: list[dict]) -> torch.optim.Optimizer:
    """``adamw`` with PyTorch's defaults (lr 1e-3, betas (0.9, 0.999), weight decay 0.01)."""
    return adamw(groups)


ADAMW_ONLY = ("*embed*", "*wte*", "*wpe*", "*lm_head*")
"""Name patterns (fnmatch) of 2-D parameters ``muon_groups`` leaves to AdamW: input
embeddings and the output head (Muon is meant for hidden layers' matrices)."""


def muon_groups(
    groups: list[dict], *, adamw_only: Sequence[str] = ADAMW_ONLY
) -> tuple[list[dict], list[dict]]:
    """fxmeg's parameter groups split for Muon + AdamW: (Muon's groups: 2-D parameters
    whose name matches none of ``adamw_only``; AdamW's groups: the rest), each keeping its
    group's options. Every group is kept on both sides, possibly empty, so every rank
    builds the same groups whatever parameters it updates."""
    muon, rest = [], []
    for g in groups:
        names = g.get("param_names")
        if names is None:
            raise ConfigError(
                "muon_groups needs each group's 'param_names' (fxmeg's param_groups give them)"
            )
        pick = [p.dim() == 2 and not any(fnmatch.fnmatchcase(n, pat) for pat in adamw_only)
                for n, p in zip(names, g["params"])]
        for side, want in ((muon, True), (rest, False)):
            chosen = [i for i, m in enumerate(pick) if m == want]
            side.append({**g, "params": [g["params"][i] for i in chosen],
                         "param_names": [names[i] for i in chosen]})
    return muon, rest


def muon_adamw(
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = "match_rms_adamw",
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    adamw_lr: float | None = None,
    adamw_only: Sequence[str] = ADAMW_ONLY,
) -> OptimizerFactory:
    """A factory for ``parallelize(optimizer=...)``: torch.optim.Muon on the hidden layers'
    matrices, AdamW (``adamw``) on everything else (``muon_groups``). With Moonshot's
    ``adjust_lr_fn='match_rms_adamw'`` one lr and weight decay serve both; ``adamw_lr``
    gives AdamW its own lr (kept as ``lr_mult`` so an lr schedule keeps the ratio). Muon
    refuses 1-D parameters, so it never sees biases or norms. With the distributed
    optimizer it runs layer-wise (``optimizer_sharding='auto'`` picks it)."""

    def factory(groups: list[dict]) -> list[torch.optim.Optimizer]:
        matrices, rest = muon_groups(groups, adamw_only=adamw_only)
        if adamw_lr is not None:
            rest = [{**g, "lr_mult": g.get("lr_mult", 1.0) * adamw_lr / lr} for g in rest]
        return [
            torch.optim.Muon(
                matrices,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
            ),
            adamw(
                rest,
                lr=lr if adamw_lr is None else adamw_lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
            ),
        ]

    return factory


_ELEMENTWISE = tuple(
    getattr(torch.optim, n)
    for n in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
        "SparseAdam",
    )
    if hasattr(torch.optim, n)
)
_WHOLE = tuple(getattr(torch.optim, n) for n in ("Muon", "Adafactor") if hasattr(torch.optim, n))


def is_elementwise(optimizer) -> bool | None:
    """True when each element's update reads only that element's gradient and state (any
    cut into pieces steps exactly as the whole), False when it needs the parameter's whole
    shape, None when fxmeg does not know. An optimizer declares it with a boolean
    ``elementwise`` attribute (class or instance); else torch's own are known: SGD, Adam,
    AdamW, Adamax, NAdam, RAdam, Adagrad, Adadelta, RMSprop, Rprop, ASGD are elementwise,
    Muon and Adafactor (factored second moments) are not."""
    declared = getattr(optimizer, "elementwise", None)
    if isinstance(declared, bool):
        return declared
    if isinstance(optimizer, _WHOLE):
        return False
    if isinstance(optimizer, _ELEMENTWISE):
        return True
    return None


@dataclass(frozen=True)
class OptimizerPlan:
    """What the factory builds, learnt on stand-ins of every parameter's full shape."""

    kinds: tuple[str, ...]
    """Class name of each inner optimizer, in the factory's order."""
    elementwise: tuple[bool | None, ...]
    """``is_elementwise`` of each."""
    route: Mapping[str, int]
    """Parameter -> index of the inner optimizer that updates it."""

    def whole(self, name: str) -> bool:
        """Whether ``name``'s optimizer must see the whole (tp-unsharded) parameter: unless
        it is known to be elementwise."""
        return self.elementwise[self.route[name]] is not True

    def sharding(self, distributed: bool, requested: str, *, overlap_param_gather: bool = False,
                 zero: int = 1) -> OptimizerSharding:
        """``fxmeg.sharding_modes.decide_sharding`` for what this factory builds: 'auto' is
        LAYERWISE iff an inner optimizer is known not to be elementwise. Raises ConfigError
        when the request cannot hold (before any process group)."""
        whole = tuple(k for k, e in zip(self.kinds, self.elementwise) if e is False)
        return decide_sharding(distributed=distributed, requested=requested, whole=whole,
                               overlap_param_gather=overlap_param_gather, zero=zero)


def plan_optimizers(
    factory: OptimizerFactory, template: list[dict], device: torch.device
) -> OptimizerPlan:
    """Call ``factory`` on ``template`` (fxmeg's groups of the whole model) with every
    parameter replaced by a stand-in of its full shape that holds no memory; learn which
    optimizer takes which parameter. Refuses a factory that leaves a parameter out or
    gives one to two optimizers."""
    stand_ins = {n: torch.empty((), device=device).expand(p.shape)
                 for g in template for n, p in zip(g["param_names"], g["params"])}
    groups = [{**g, "params": [stand_ins[n] for n in g["param_names"]]} for g in template]
    optimizers = as_list(factory(groups))
    route = routes(optimizers, {id(t): n for n, t in stand_ins.items()})
    return OptimizerPlan(tuple(type(o).__name__ for o in optimizers),
                         tuple(is_elementwise(o) for o in optimizers), route)


def as_list(made) -> list:
    """What a factory returned, as a list of optimizers (refusing anything else)."""
    if hasattr(made, "param_groups"):
        return [made]
    if isinstance(made, (list, tuple)) and made and all(hasattr(o, "param_groups") for o in made):
        return list(made)
    raise ConfigError(
        f"the optimizer factory must return an optimizer or a non-empty list of them; got {made!r}"
    )


def routes(optimizers: list, name_of: dict[int, str]) -> dict[str, int]:
    """Parameter name -> index of the optimizer holding it; each exactly once."""
    route: dict[str, int] = {}
    for i, opt in enumerate(optimizers):
        for g in opt.param_groups:
            for p in g["params"]:
                name = name_of.get(id(p))
                if name is None:
                    raise ConfigError(
                        f"optimizer {i} ({type(opt).__name__}) holds a tensor that is not one of "
                        "the parameter groups' tensors; build the optimizers from the groups given"
                    )
                if name in route:
                    raise ConfigError(
                        f"parameter {name!r} is in optimizer {route[name]} and optimizer {i}; "
                        "several optimizers must hold disjoint parameters"
                    )
                route[name] = i
    missing = sorted(set(name_of.values()) - set(route))
    if missing:
        raise ConfigError(
            f"{len(missing)} parameter(s) are in no optimizer the factory returned, e.g. "
            f"{missing[:3]}; every parameter must be updated by exactly one"
        )
    return route


class Optimizers:
    """Several inner optimizers over disjoint parameters, used as one: their
    ``param_groups`` end to end (the lr schedule drives them all; the first group's lr
    is the step's reported lr), ``state`` by master, ``step`` steps each in order."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.state = _States(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class _States(MutableMapping):
    """The inner optimizers' states as one mapping, each master's in its own optimizer."""

    def __init__(self, optimizers: list) -> None:
        self._owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}
        self._optimizers = optimizers

    def __getitem__(self, key):
        owner = self._owner.get(id(key))
        if owner is None or key not in owner.state:
            raise KeyError(key)
        return owner.state[key]

    def __setitem__(self, key, value) -> None:
        self._owner[id(key)].state[key] = value

    def __delitem__(self, key) -> None:
        del self._owner[id(key)].state[key]

    def __iter__(self) -> Iterator:
        return (k for o in self._optimizers for k in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)
