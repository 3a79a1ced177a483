"""The optimizer around the user's inner optimizer(s) (docs/architecture.md §5.3-5.4;
docs/megatron-semantics.md §2.7; Megatron's MixedPrecisionOptimizer,
Float16OptimizerWithFloat16Params, DistributedOptimizer and its layer-wise variant).

The inner optimizers step fp32 *masters*, one per piece of a parameter this rank updates:
  * no distributed optimizer: every parameter, whole, on every rank: fp32 parameters
    themselves, half precision a full fp32 copy;
  * distributed optimizer, ``optimizer_sharding='elementwise'`` (ZeRO-1): only the part of
    each parameter that falls in this data-parallel rank's shard of its bucket; for fp32
    parameters that part of the parameter buffer itself, for half precision an fp32 copy;
  * distributed optimizer, ``'layerwise'``: the whole parameters assigned to this
    data-parallel rank (``fxmeg.runtime.optimizer.layerwise.assign``), as in the first case.
A whole parameter split over tensor-parallel ranks is stepped as its *full* matrix when its
inner optimizer is not known to be elementwise (``is_elementwise``): the tp ranks gather its
gradient, step identical fp32 full masters and each keeps its own shard of the result.

A master's gradient is the matching view of the fp32 gradient buffer (for a full matrix, the
gathered gradient). ``step`` checks for inf/NaN (fp16) everywhere, clips the global norm,
steps, copies masters back into the parameters and brings every data-parallel rank the
updated values (all-gather of bucket shards, or of the layer-wise owners' parameters).

The factory may return one optimizer or several over disjoint parameters (e.g. Muon for
matrices and AdamW for the rest, ``muon_adamw``). It is called on stand-ins of every
parameter's full shape, to learn which optimizer takes which parameter and whether it is
elementwise (``OptimizerPlan``: once by ``parallelize`` on the model's parameters, to
decide the sharding before the passes, once by the runtime on the Program's), then on
this rank's masters; the calls must route every parameter to the same optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fxmeg.config import EngineConfig
from fxmeg.errors import ConfigError, NonFiniteGradError
from fxmeg.ir.layouts import ParamLayout, is_split
from fxmeg.runtime.data_parallel.ddp import DataParallel, GradBuffer
from fxmeg.runtime.groups import Groups, all_reduce, shard_range
from fxmeg.runtime.optimizer.inner_optimizers import (
    ADAMW_ONLY,
    OptimizerFactory,
    OptimizerPlan,
    Optimizers,
    adamw,
    as_list,
    default_optimizer,
    is_elementwise,
    muon_adamw,
    muon_groups,
    param_groups,
    plan_optimizers,
    routes,
)
from fxmeg.runtime.optimizer.layerwise import ParamGather, assign, gather_tp
from fxmeg.sharding_modes import OptimizerSharding
from fxmeg.torch_private import foreach_mul_, foreach_norm
from fxmeg.weights.sharding import tp_shard

# the inner optimizers' names (fxmeg.runtime.optimizer.inner_optimizers) are public here too
__all__ = [
    "ADAMW_ONLY",
    "FullSource",
    "MasterSource",
    "MasterSources",
    "Optimizer",
    "OptimizerFactory",
    "OptimizerPlan",
    "Optimizers",
    "StepOptions",
    "StepOutcome",
    "adamw",
    "default_optimizer",
    "is_elementwise",
    "muon_adamw",
    "muon_groups",
    "param_groups",
    "plan_optimizers",
]

MasterSource = Callable[[str, int, int], torch.Tensor]
"""(parameter, lo, hi) -> fp32 values of elements [lo, hi) of this rank's flat shard of it."""
FullSource = Callable[[str], torch.Tensor]
"""parameter -> its full (tensor-parallel-unsharded) fp32 values, a new tensor."""


@dataclass
class _Piece:
    """One contiguous part of a parameter that this rank's inner optimizer updates."""

    name: str
    param: nn.Parameter
    master: torch.Tensor
    """What the inner optimizer steps (fp32)."""
    grad: torch.Tensor
    """Its gradient: a view of the fp32 gradient buffer (for a full matrix, a buffer the
    tp ranks' gradients are gathered into before each step)."""
    target: torch.Tensor | None
    """Where the master is copied after the step; None when the master is that storage."""
    in_norm: bool
    """Whether the global norm counts it: False for a tied weight's copy on a later
    pipeline holder and for a tp-replicated parameter (or a full matrix) on tp ranks
    other than 0."""
    lo: int
    hi: int
    """The elements [lo, hi) of the parameter (its local shard, flattened) it covers; for a
    full matrix, of the full tensor."""
    spec: ParamLayout | None = None
    """Set for the full matrix of a tp-split parameter: its split (the master is full,
    the target the local shard)."""

    def write_back(self, tp: int, tp_rank: int) -> None:
        """Copy the master (its tp shard, for a full matrix) into the parameter."""
        if self.target is not None:
            self.target.copy_(
                self.master if self.spec is None else tp_shard(self.master, self.spec, tp, tp_rank)
            )


@dataclass(frozen=True)
class StepOutcome:
    skipped: bool
    grad_norm: float | None
    skip_reason: str | None = None
    """'nonfinite' (inf / NaN in a gradient) or 'grad_norm' (above the spike bound)."""


@dataclass(frozen=True)
class StepOptions:
    """How ``Optimizer.step`` treats the reduced gradients (``of``: from the EngineConfig)."""

    clip_grad: float
    """Clip the global L2 norm to this; 0: no clipping."""
    check_nonfinite: bool
    """Look for inf / NaN every step (check_for_nan_in_grad; fp16 always does)."""
    raise_on_nonfinite: bool = False
    """Raise NonFiniteGradError instead of skipping the step (on_nonfinite='raise'; never in
    fp16, whose loss scaler backs off on such steps)."""
    max_grad_norm: float = 0.0
    """Skip a step whose global norm exceeds this (skip_on_grad_norm_above; 0: off)."""
    overlap_param_gather: bool = False
    """Elementwise sharding: gather the updated parameters in the background."""

    @classmethod
    def of(cls, config: EngineConfig) -> StepOptions:
        fp16 = config.precision == "fp16"
        guards = config.guards
        return cls(clip_grad=config.clip_grad, check_nonfinite=guards.check_for_nan_in_grad or fp16,
                   raise_on_nonfinite=guards.on_nonfinite == "raise" and not fp16,
                   max_grad_norm=guards.skip_on_grad_norm_above,
                   overlap_param_gather=config.data_parallel.overlap_param_gather)


@dataclass(frozen=True)
class MasterSources:
    """Where the fp32 masters start from when not from the parameters' own values."""

    fp32: MasterSource | None = None
    """Elements of a parameter's local shard: the user's fp32 values of a model cast to
    half precision (None: the parameters' values, upcast)."""
    full: FullSource | None = None
    """A tp-split parameter's full fp32 values, for an optimizer that steps the whole
    matrix (None: gathered from the tp shards, collective)."""


class Optimizer:
    """Masters, inf/NaN check, clipping, inner step, copy back, parameter gather."""

    def __init__(
        self,
        named: dict[str, nn.Parameter],
        ddp: DataParallel,
        factory: OptimizerFactory,
        *,
        groups: Groups,
        holders: Mapping[str, Sequence[int]],
        template: list[dict],
        plan: OptimizerPlan,
        sharding: OptimizerSharding,
        options: StepOptions,
        tp_specs: Mapping[str, ParamLayout] | None = None,
        experts: frozenset[str] = frozenset(),
        sources: MasterSources = MasterSources(),
    ) -> None:
        self.groups, self.ddp, self.sharding, self.options = groups, ddp, sharding, options
        self.distributed = sharding is not OptimizerSharding.NONE
        self.tp, self.tp_rank = groups.topo.tp, groups.tp_rank
        tp_specs = tp_specs or {}
        split = {n for n, spec in tp_specs.items() if is_split(spec)}
        self.owner: dict[str, int] | None = None
        """Layer-wise: parameter -> the data-parallel rank that updates it."""
        self.gather: ParamGather | None = None
        if sharding is OptimizerSharding.LAYERWISE:
            sizes = {n: p.numel() * (self.tp if n in split else 1) for n, p in named.items()}
            self.owner = assign(sizes, groups.dp_cp_size)
            self.gather = ParamGather(named, self.owner, groups.dp_cp)
        # the first pipeline holder
        first = {n: min(h) == groups.pp_rank for n, h in holders.items()}
        if sharding is OptimizerSharding.ELEMENTWISE:
            self.pieces = _sharded_pieces(ddp, self._counted(first, split), sources.fp32)
        else:
            self.pieces = self._whole_pieces(named, first, split, plan, tp_specs, sources)
        self.optimizers = _inner_optimizers(factory, template, plan, self.pieces)
        self.inner = (
            self.optimizers[0] if len(self.optimizers) == 1 else Optimizers(self.optimizers)
        )
        self._full = [p for p in self.pieces if p.spec is not None]
        self._in_norm = torch.tensor(
            [p.in_norm for p in self.pieces], dtype=torch.bool, device=self._device()
        )
        self._expert = torch.tensor(
            [p.name in experts for p in self.pieces], dtype=torch.bool, device=self._device()
        )
        """Pieces of expert banks: without the distributed optimizer each ep rank holds other
        experts, so their squares are summed over the ep group too."""

    def _counted(self, first: dict[str, bool], split: set[str]) -> dict[str, bool]:
        """Parameter -> whether the global norm counts it on this rank, so that each
        element counts once: tied weights on their first pipeline holder, tp-replicated
        parameters (and full matrices) on tp rank 0."""
        return {n: is_first and (n in split or self.tp_rank == 0) for n, is_first in first.items()}

    def _whole_pieces(
        self,
        named: dict[str, nn.Parameter],
        first: dict[str, bool],
        split: set[str],
        plan: OptimizerPlan,
        tp_specs: Mapping[str, ParamLayout],
        sources: MasterSources,
    ) -> list[_Piece]:
        """One piece per whole parameter this rank updates (every one, or layer-wise the
        ones it owns); a tp-split one as its full matrix when its optimizer needs it."""
        counted, pieces = self._counted(first, split), []
        for n, p in named.items():
            if self.owner is not None and self.owner[n] != self.groups.dp_cp_rank:
                continue
            if n in split and self.groups.tp is not None and plan.whole(n):
                in_norm = first[n] and self.tp_rank == 0
                pieces.append(
                    _matrix_piece(n, p, in_norm, tp_specs[n], self.groups.tp, sources.full)
                )
            else:
                pieces.append(_full_piece(n, p, counted[n], sources.fp32))
        return pieces

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self) -> StepOutcome:
        """One update from the finalized gradients (docs/megatron-semantics.md §2.7). Every rank
        takes the same decision: skip on inf / NaN anywhere (or raise, naming where), skip when
        the global norm exceeds max_grad_norm, else clip and update. The inf / NaN test rides on
        the norm's reduction: no extra pass over the gradients, no extra collective."""
        self.ddp.wait_for_params()  # last step's gathers must land before masters copy back
        for piece in self._full:  # full matrices: every tp rank's gradient shard
            piece.grad.copy_(gather_tp(piece.param.main_grad, piece.spec, self.groups.tp))
        norm, finite = self._norm_and_finite("grad")
        if self.options.check_nonfinite and not finite:
            if self.options.raise_on_nonfinite:
                rank, name = self._nonfinite()
                raise NonFiniteGradError(
                    f"gradient of {name!r} holds inf or NaN on rank {rank} (after the "
                    f"data-parallel reduction); set on_nonfinite='skip' to skip such steps"
                )
            return StepOutcome(skipped=True, grad_norm=None, skip_reason="nonfinite")
        if self.options.max_grad_norm and norm > self.options.max_grad_norm:
            return StepOutcome(skipped=True, grad_norm=norm, skip_reason="grad_norm")
        self._clip(norm)
        for piece in self.pieces:
            piece.master.grad = piece.grad
        self.inner.step()
        for piece in self.pieces:
            piece.master.grad = None
            piece.write_back(self.tp, self.tp_rank)
        if self.sharding is OptimizerSharding.ELEMENTWISE:
            for buf in self.ddp.all():
                buf.gather_params(overlap=self.options.overlap_param_gather)
        elif self.gather is not None:
            self.gather()
        return StepOutcome(skipped=False, grad_norm=norm)

    def reload(self) -> None:
        """After a checkpoint load: in half precision the parameters follow the loaded
        masters; an fp32 master that is a copy (a full matrix of a tp-split parameter)
        follows the loaded parameters (collective over tp)."""
        for piece in self.pieces:
            if piece.target is None:
                continue
            if piece.param.dtype == torch.float32:
                piece.master.copy_(gather_tp(piece.target, piece.spec, self.groups.tp))
            else:
                piece.write_back(self.tp, self.tp_rank)

    def _nonfinite(self) -> tuple[int, str]:
        """(rank, parameter) of the first inf / NaN gradient over every rank (every rank
        calls this once the reduced norm showed one)."""
        first = next((p.name for p in self.pieces if not torch.isfinite(p.grad).all()), None)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return (0, first)
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, first)
        return next((r, name) for r, name in enumerate(found) if name is not None)

    def global_norm(self, which: str) -> float:
        """L2 norm over every rank of the pieces' "grad" or "master" (parameter values),
        each element counted once: tied weights once, tp-replicated parameters once,
        distributed-optimizer shards and layer-wise owners once. Collective over the
        model's ranks."""
        return self._norm_and_finite(which)[0]

    @torch.no_grad()
    def _norm_and_finite(self, which: str) -> tuple[float, bool]:
        """The global norm, and whether every piece on every rank is finite (the pieces
        the norm leaves out too), from one reduction of two numbers per group."""
        tensors = [getattr(p, which) for p in self.pieces]
        sums = torch.zeros(2, dtype=torch.float64, device=self._device())
        experts = torch.zeros(2, dtype=torch.float64, device=self._device())
        if tensors:
            squares = torch.stack(foreach_norm(tensors)).double() ** 2
            mine = ~self._expert
            sums = torch.stack([squares[self._in_norm & mine].sum(), squares[mine].sum()])
            experts = torch.stack(
                [squares[self._in_norm & self._expert].sum(), squares[self._expert].sum()]
            )
        if not self.distributed:  # distributed: expert shards are disjoint over dp x cp too
            all_reduce(experts, self.groups.ep)
        sums += experts
        if self.distributed:
            all_reduce(sums, self.groups.dp_cp)
        all_reduce(sums, self.groups.tp)
        all_reduce(sums, self.groups.pp)
        total, everything = sums.tolist()
        return math.sqrt(total), math.isfinite(everything)

    def _clip(self, norm: float) -> None:
        """Scale the gradients when the global norm exceeds clip_grad."""
        if self.options.clip_grad > 0:
            coeff = self.options.clip_grad / (norm + 1e-6)
            if coeff < 1.0 and self.pieces:  # Megatron: clip_grad_norm_fp32
                foreach_mul_([p.grad for p in self.pieces], coeff)

    def _device(self) -> torch.device:
        return self.pieces[0].grad.device if self.pieces else torch.device("cpu")

    def state_elements(self) -> dict[str, int]:
        """Elements of the masters and of each inner-optimizer state tensor on this rank."""
        out = {"master": sum(p.master.numel() for p in self.pieces)}
        for state in self.inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out[key] = out.get(key, 0) + value.numel()
        return out


def _inner_optimizers(factory: OptimizerFactory, template: list[dict], plan: OptimizerPlan,
                      pieces: list[_Piece]) -> list:
    """The factory on this rank's masters, in every group of ``template`` (possibly empty:
    the same structure on every rank); each master routed as ``plan`` says."""
    masters = {piece.name: piece.master for piece in pieces}
    assert len(masters) == len(pieces), "one piece per parameter"
    groups = []
    for g in template:
        names = [n for n in g["param_names"] if n in masters]
        groups.append({**g, "params": [masters[n] for n in names], "param_names": names})
    optimizers = as_list(factory(groups))
    route = routes(optimizers, {id(m): n for n, m in masters.items()})
    moved = sorted(n for n, i in route.items() if plan.route[n] != i)
    if moved:
        raise ConfigError(
            f"the optimizer factory routed {moved[0]!r} to optimizer {route[moved[0]]} on this "
            f"rank's masters but to optimizer {plan.route[moved[0]]} on full-shape stand-ins; "
            "route by group['param_names'] (masters may be flat slices or tp shards)"
        )
    return optimizers


def _full_piece(name, param, in_norm, fp32_source) -> _Piece:
    if param.dtype == torch.float32:
        return _Piece(name, param, param, param.main_grad, None, in_norm, 0, param.numel())
    master = _master(fp32_source, name, param.detach(), 0, param.numel()).view(param.shape)
    return _Piece(name, param, master, param.main_grad, param.data, in_norm, 0, param.numel())


def _matrix_piece(name, param, in_norm, spec, group, full_source) -> _Piece:
    """A tp-split parameter stepped as its full matrix: a full fp32 master (the user's fp32
    values in half precision, else gathered from the tp shards, collective), and a full
    gradient buffer the tp ranks' gradients are gathered into before each step."""
    if full_source is not None:
        master = full_source(name)
    else:
        master = gather_tp(param.detach(), spec, group).float()
    return _Piece(
        name, param, master, torch.zeros_like(master), param.data, in_norm, 0, master.numel(), spec
    )


def _sharded_pieces(ddp: DataParallel, first_holder, fp32_source) -> list[_Piece]:
    """Per bucket, the parts of parameters inside this rank's shard of it (over the
    buffer's group: dp x cp, or the expert-data-parallel ranks for banks of experts)."""
    pieces = []
    for buf in ddp.all():
        for bucket in buf.layout.buckets:
            lo, hi = shard_range(bucket.start, bucket.end, buf.group)
            for name in bucket.params:
                slot = buf.layout.slot(name)
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    pieces.append(_shard_piece(buf, name, a, b, first_holder[name], fp32_source))
    return pieces


def _shard_piece(buf: GradBuffer, name, a: int, b: int, in_norm, fp32_source) -> _Piece:
    param, grad, storage = buf.params[name], buf.grad_piece(a, b), buf.param_piece(a, b)
    offset = buf.layout.slot(name).offset
    lo, hi = a - offset, b - offset
    if storage.dtype == torch.float32:
        return _Piece(name, param, storage, grad, None, in_norm, lo, hi)
    return _Piece(
        name, param, _master(fp32_source, name, storage, lo, hi), grad, storage, in_norm, lo, hi
    )


def _master(fp32_source, name: str, half: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The fp32 master of elements [lo, hi) of ``name``'s local shard: from the user's fp32
    values when the model was cast for half precision, else from the half-precision
    values themselves (``half`` holds exactly those elements)."""
    if fp32_source is not None:
        return fp32_source(name, lo, hi)
    return half.detach().float().reshape(-1).clone()
