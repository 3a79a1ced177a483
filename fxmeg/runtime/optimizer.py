"""The optimizer around the user's inner optimizer (docs/design.md §8.7; Megatron's
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

from fxmeg.errors import FxmegError
from fxmeg.runtime.ddp import DataParallel, GradBuffer
from fxmeg.runtime.groups import Groups, all_reduce, shard_range

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
MasterSource = Callable[[str, int, int], torch.Tensor]
"""(parameter, lo, hi) -> fp32 values of elements [lo, hi) of this rank's flat shard of it."""


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
    skip_reason: str | None = None
    """'nonfinite' (inf / NaN in a gradient) or 'grad_norm' (above the spike bound)."""


class NonFiniteGradError(FxmegError):
    """A gradient held inf or NaN and the run asked to stop (on_nonfinite='raise')."""


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
        check_nonfinite: bool,
        raise_on_nonfinite: bool = False,
        max_grad_norm: float = 0.0,
        fp32_source: MasterSource | None = None,
    ) -> None:
        self.groups, self.distributed, self.clip_grad = groups, distributed, clip_grad
        self.overlap_param_gather = overlap_param_gather
        self.check_nonfinite, self.raise_on_nonfinite = check_nonfinite, raise_on_nonfinite
        self.max_grad_norm = max_grad_norm
        self.ddp = ddp
        tp_rank = groups.topo.coords(groups.rank)[0]
        counted = {  # each element once: tied weights on their first pipeline holder,
            n: min(h) == groups.pp_rank and (n in tp_sharded or tp_rank == 0)  # replicas on tp rank 0
            for n, h in holders.items()
        }
        self.pieces = (
            _sharded_pieces(ddp, groups.dp, counted, fp32_source)
            if distributed
            else [_full_piece(n, p, counted[n], fp32_source) for n, p in named.items()]
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
        self._in_norm = torch.tensor([p.in_norm for p in self.pieces], dtype=torch.bool, device=self._device())

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self) -> StepOutcome:
        """One update from the finalized gradients (docs/design.md §8.7). Every rank takes the
        same decision: skip on inf / NaN anywhere (or raise, naming where), skip when the
        global norm exceeds max_grad_norm, else clip and update. The inf / NaN test rides
        on the norm's reduction: no extra pass over the gradients, no extra collective."""
        self.ddp.wait_for_params()  # last step's gathers must land before masters copy back
        norm, finite = self._norm_and_finite("grad")
        if self.check_nonfinite and not finite:
            if self.raise_on_nonfinite:
                rank, name = self._nonfinite()
                raise NonFiniteGradError(
                    f"gradient of {name!r} holds inf or NaN on rank {rank} (after the "
                    f"data-parallel reduction); set on_nonfinite='skip' to skip such steps"
                )
            return StepOutcome(skipped=True, grad_norm=None, skip_reason="nonfinite")
        if self.max_grad_norm and norm > self.max_grad_norm:
            return StepOutcome(skipped=True, grad_norm=norm, skip_reason="grad_norm")
        self._clip(norm)
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
        distributed-optimizer shards once. Collective over the model's ranks."""
        return self._norm_and_finite(which)[0]

    @torch.no_grad()
    def _norm_and_finite(self, which: str) -> tuple[float, bool]:
        """The global norm, and whether every piece on every rank is finite (the pieces
        the norm leaves out too), from one reduction of two numbers per group."""
        tensors = [getattr(p, which) for p in self.pieces]
        sums = torch.zeros(2, dtype=torch.float64, device=self._device())
        if tensors:
            squares = torch.stack(torch._foreach_norm(tensors)).double() ** 2
            sums = torch.stack([squares[self._in_norm].sum(), squares.sum()])
        if self.distributed:
            all_reduce(sums, self.groups.dp)
        all_reduce(sums, self.groups.tp)
        all_reduce(sums, self.groups.pp)
        total, everything = sums.tolist()
        return math.sqrt(total), math.isfinite(everything)

    def _clip(self, norm: float) -> None:
        """Scale the gradients when the global norm exceeds clip_grad."""
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1e-6)
            if coeff < 1.0 and self.pieces:  # Megatron: clip_grad_norm_fp32
                torch._foreach_mul_([p.grad for p in self.pieces], coeff)

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


def _full_piece(name, param, in_norm, fp32_source) -> _Piece:
    if param.dtype == torch.float32:
        return _Piece(name, param, param, param.main_grad, None, in_norm, 0, param.numel())
    master = _master(fp32_source, name, param.detach(), 0, param.numel()).view(param.shape)
    return _Piece(name, param, master, param.main_grad, param.data, in_norm, 0, param.numel())


def _sharded_pieces(ddp: DataParallel, group, first_holder, fp32_source) -> list[_Piece]:
    """Per bucket, the parts of parameters inside this data-parallel rank's shard."""
    pieces = []
    for buf in ddp.all():
        for bucket in buf.layout.buckets:
            lo, hi = shard_range(bucket.start, bucket.end, group)
            for name in bucket.params:
                slot = buf.layout.slot(name)
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    pieces.append(_shard_piece(buf, name, a, b, first_holder[name], fp32_source))
    return pieces


def _shard_piece(buf: GradBuffer, name, a: int, b: int, in_norm, fp32_source) -> _Piece:
    param, grad, storage = buf.params[name], buf.data[a:b], buf.param_data[a:b]
    offset = buf.layout.slot(name).offset
    lo, hi = a - offset, b - offset
    if storage.dtype == torch.float32:
        return _Piece(name, param, storage, grad, None, in_norm, lo, hi)
    return _Piece(name, param, _master(fp32_source, name, storage, lo, hi), grad, storage, in_norm, lo, hi)


def _master(fp32_source, name: str, half: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The fp32 master of elements [lo, hi) of ``name``'s local shard: from the user's fp32
    values when the model was cast for half precision, else from the half-precision
    values themselves (``half`` holds exactly those elements)."""
    if fp32_source is not None:
        return fp32_source(name, lo, hi)
    return half.detach().float().reshape(-1).clone()
