"""Whole parameters per data-parallel rank (docs/architecture.md §5.4; Megatron's layer-wise
distributed optimizer), and full matrices across tensor-parallel ranks, for inner
optimizers that need a parameter's whole shape (torch.optim.Muon, Shampoo-like ones).

* ``assign``: which data-parallel rank updates each parameter, balanced by elements,
  deterministic and the same on every rank (a pure function of names and sizes).
* ``ParamGather``: after the step, every owner's updated parameters reach the other
  data-parallel ranks, one all-gather of a packed buffer per parameter dtype.
* ``gather_tp``: a tensor-parallel shard's full tensor (every tp rank's shard, blocks
  reassembled as ``fxmeg.weights.sharding.tp_shard`` cut them).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from fxmeg.ir.layouts import ParamLayout, is_split
from fxmeg.runtime.groups import WeakGroup, all_gather_
from fxmeg.weights.sharding import tp_assemble


def assign(sizes: Mapping[str, int], ranks: int) -> dict[str, int]:
    """Parameter name -> the data-parallel rank that updates it. Largest first (ties by
    name), each to the rank with the fewest elements so far (ties: the lowest rank):
    the greedy longest-processing-time rule, within 4/3 of the best possible maximum.
    ``sizes`` are full (tensor-parallel-unsharded) element counts, so the tp ranks of
    one data-parallel rank own the same parameters."""
    loads = [0] * ranks
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        out[name] = rank
        loads[rank] += sizes[name]
    return out


class ParamGather:
    """Broadcasts every data-parallel rank's updated parameters to the others: per dtype,
    each rank packs the parameters it owns (by name) into its equal segment of one
    buffer, padded to the largest rank's elements; one all-gather; each rank unpacks
    the others' segments into its parameters."""

    group = WeakGroup()  # never holds the group alive (fxmeg/runtime/groups.py)

    def __init__(self, params: Mapping[str, nn.Parameter], owner: Mapping[str, int],
                 group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.plans: list[tuple[torch.dtype, list[list[nn.Parameter]], int]] = []
        if group is None:
            return
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        by_dtype: dict[torch.dtype, list[list[nn.Parameter]]] = {}
        for name in sorted(params):
            p = params[name]
            by_dtype.setdefault(p.dtype, [[] for _ in range(world)])[owner[name]].append(p)
        for dtype, lists in by_dtype.items():
            self.plans.append((dtype, lists, max(sum(p.numel() for p in ps) for ps in lists)))

    @torch.no_grad()
    def __call__(self) -> None:
        for dtype, lists, size in self.plans:
            device = next(p.device for ps in lists for p in ps)
            flat = torch.empty(size * len(lists), dtype=dtype, device=device)
            _pack(lists[self.rank], flat[self.rank * size :], to_flat=True)
            work = all_gather_(flat, self.group)
            if work is not None:
                work.wait()
            for r, ps in enumerate(lists):
                if r != self.rank:
                    _pack(ps, flat[r * size :], to_flat=False)


def _pack(params: list[nn.Parameter], flat: torch.Tensor, *, to_flat: bool) -> None:
    offset = 0
    for p in params:
        segment = flat[offset : offset + p.numel()].view(p.shape)
        if to_flat:
            segment.copy_(p.detach())
        else:
            p.detach().copy_(segment)
        offset += p.numel()


def gather_tp(
    local: torch.Tensor, spec: ParamLayout | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The full tensor of a tensor-parallel shard (a new tensor; a copy of ``local`` when
    it is not split). Collective over ``group``."""
    if not is_split(spec) or group is None:
        return local.detach().clone()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.detach().contiguous(), group=group)
    return tp_assemble(shards, spec)
