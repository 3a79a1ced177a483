"""The optimizer around the user's inner optimizer (reference §7; Megatron's
MixedPrecisionOptimizer, Float16OptimizerWithFloat16Params and DistributedOptimizer).

The inner optimizer steps fp32 *masters*, one per piece of a parameter this rank updates:
  * fp32 parameters, no distributed optimizer: the parameter itself;
  * bf16 / fp16 parameters, no distributed optimizer: a full fp32 copy (every rank);
  * distributed optimizer (ZeRO-1): only the part of each parameter that falls in this
    data-parallel rank's shard of its bucket; for fp32 parameters that part of the
    parameter buffer itself, for half precision an fp32 copy of it.
A master's gradient is the matching view of the fp32 gradient buffer. ``step`` checks
for inf/NaN (fp16) everywhere, clips the global norm, steps, copies masters back into
the parameters and all-gathers the updated shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fxmeg.runtime.ddp import DataParallel, GradBuffer
from fxmeg.runtime.groups import Groups, all_reduce, shard_range

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """Megatron's default groups: weight decay for matrices, none for 1-D parameters
    (biases, norm weights); ``wd_mult`` tells a weight-decay schedule which groups it
    drives. A factory that wants one group can flatten them:
    ``lambda groups: AdamW([p for g in groups for p in g["params"]])``."""
    decay, no_decay = [], []
    for _, p in named:
        if p.requires_grad:
            (no_decay if p.dim() <= 1 else decay).append(p)
    groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    return [g for g in groups if g["params"]]


def default_optimizer(groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults (lr 1e-3, betas (0.9, 0.999), weight decay 0.01)."""
    return torch.optim.AdamW(groups)


@dataclass
class _Piece:
    """One contiguous part of a parameter that this rank's inner optimizer updates."""

    name: str
    param: nn.Parameter
    master: torch.Tensor
    """What the inner optimizer steps (fp32)."""
    grad: torch.Tensor
    """Its gradient: a view of the fp32 gradient buffer."""
    target: torch.Tensor | None
    """Where the master is copied after the step; None when the master is that storage."""
    in_norm: bool
    """Whether the global norm counts it: False for a tied weight's copy on a later
    pipeline holder and for a tp-replicated parameter on tp ranks other than 0."""
    lo: int
    hi: int
    """The elements [lo, hi) of the parameter (its local shard, flattened) it covers."""


@dataclass(frozen=True)
class StepOutcome:
    skipped: bool
    grad_norm: float | None


class Optimizer:
    """Masters, inf/NaN check, clipping, inner step, copy back, parameter gather."""

    def __init__(
        self,
        named: dict[str, nn.Parameter],
        ddp: DataParallel,
        factory: OptimizerFactory,
        *,
        groups: Groups,
        holders: dict[str, list[int]],
        distributed: bool,
        overlap_param_gather: bool = False,
        tp_sharded: set[str] = frozenset(),
        clip_grad: float,
        check_overflow: bool,
        fp32_values: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.groups, self.distributed, self.clip_grad = groups, distributed, clip_grad
        self.overlap_param_gather = overlap_param_gather
        self.check_overflow = check_overflow
        self.ddp = ddp
        tp_rank = groups.topo.coords(groups.rank)[0]
        counted = {  # each element once: tied weights on their first pipeline holder,
            n: min(h) == groups.pp_rank and (n in tp_sharded or tp_rank == 0)  # replicas on tp rank 0
            for n, h in holders.items()
        }
        self.pieces = (
            _sharded_pieces(ddp, groups.dp, counted, fp32_values)
            if distributed
            else [_full_piece(n, p, counted[n], fp32_values) for n, p in named.items()]
        )
        by_param: dict[int, list[torch.Tensor]] = {}
        for piece in self.pieces:
            by_param.setdefault(id(piece.param), []).append(piece.master)
        inner_groups = []
        for g in param_groups(named.items()):
            masters = [m for p in g["params"] for m in by_param.get(id(p), [])]
            if masters:
                inner_groups.append({**g, "params": masters})
        self.inner = factory(inner_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self) -> StepOutcome:
        """One update from the finalized gradients (reference §7)."""
        self.ddp.wait_for_params()  # last step's gathers must land before masters copy back
        if self.check_overflow and self._found_inf():
            return StepOutcome(skipped=True, grad_norm=None)
        norm = self._clip()
        for piece in self.pieces:
            piece.master.grad = piece.grad
        self.inner.step()
        for piece in self.pieces:
            piece.master.grad = None
            if piece.target is not None:
                piece.target.copy_(piece.master)
        if self.distributed:
            for buf in self.ddp.all():
                buf.gather_params(overlap=self.overlap_param_gather)
        return StepOutcome(skipped=False, grad_norm=norm)

    def _found_inf(self) -> bool:
        """Any inf/NaN in this rank's gradients, OR-ed over every rank (all data- and
        model-parallel ranks skip together)."""
        bad = torch.zeros(1, device=self._device())
        for piece in self.pieces:
            if not torch.isfinite(piece.grad).all():
                bad.fill_(1.0)
                break
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    @torch.no_grad()
    def global_norm(self, which: str) -> float:
        """L2 norm over every rank of the pieces' "grad" or "master" (parameter values),
        each element counted once: tied weights once, tp-replicated parameters once,
        distributed-optimizer shards once. Collective over the model's ranks."""
        norms = [torch.linalg.vector_norm(getattr(p, which)) for p in self.pieces if p.in_norm]
        total = (torch.stack(norms).double() ** 2).sum() if norms else torch.zeros((), dtype=torch.float64)
        total = total.reshape(1).to(self._device())
        if self.distributed:
            all_reduce(total, self.groups.dp)
        all_reduce(total, self.groups.tp)
        all_reduce(total, self.groups.pp)
        return math.sqrt(float(total))

    def _clip(self) -> float:
        """The global gradient norm; gradients scaled when it exceeds clip_grad."""
        norm = self.global_norm("grad")
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1e-6)
            if coeff < 1.0:  # Megatron: clip_grad_norm_fp32
                for piece in self.pieces:
                    piece.grad.mul_(coeff)
        return norm

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


def _full_piece(name, param, in_norm, fp32_values) -> _Piece:
    if param.dtype == torch.float32:
        return _Piece(name, param, param, param.main_grad, None, in_norm, 0, param.numel())
    start = fp32_values[name] if fp32_values and name in fp32_values else param.detach()
    master = start.detach().clone().float()
    return _Piece(name, param, master, param.main_grad, param.data, in_norm, 0, param.numel())


def _sharded_pieces(ddp: DataParallel, group, first_holder, fp32_values) -> list[_Piece]:
    """Per bucket, the parts of parameters inside this data-parallel rank's shard."""
    pieces = []
    for buf in ddp.all():
        for bucket in buf.layout.buckets:
            lo, hi = shard_range(bucket.start, bucket.end, group)
            for name in bucket.params:
                slot = buf.layout.slot(name)
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    pieces.append(_shard_piece(buf, name, a, b, first_holder[name], fp32_values))
    return pieces


def _shard_piece(buf: GradBuffer, name, a: int, b: int, in_norm, fp32_values) -> _Piece:
    param, grad, storage = buf.params[name], buf.data[a:b], buf.param_data[a:b]
    offset = buf.layout.slot(name).offset
    lo, hi = a - offset, b - offset
    if storage.dtype == torch.float32:
        return _Piece(name, param, storage, grad, None, in_norm, lo, hi)
    source = fp32_values[name].reshape(-1)[lo:hi] if fp32_values and name in fp32_values else storage
    return _Piece(name, param, source.detach().clone().float(), grad, storage, in_norm, lo, hi)
