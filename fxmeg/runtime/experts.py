"""The all-to-all behind ``fxmeg.ir.ops.routed_experts`` once bound to an expert-parallel
group (``collectives.bind``: ``RankExperts.routed_experts``): Megatron's dropless all-to-all
token dispatcher.

Dispatch, on every rank of the ep group at once: the rows (one per routed (token, slot)
pair) arrive sorted by global expert with ``counts[E]`` rows per expert. The counts go
first (an all-to-all of an [ep, E / ep] table: how many rows each rank sends to each of
the receiver's experts), then the rows themselves (``all_to_all_single`` with the split
sizes those counts give), which arrive ordered by (sender, expert) and are regrouped by
expert for the local matmuls. Combine sends the results back the same way. Both
all-to-alls are differentiable: backward sends the gradients the reverse way.

In capacity mode (``MoEConfig.moe_capacity_factor``) every rank sends exactly
``capacity`` rows (padded) for every expert: the split sizes are known on every rank in
advance, so the counts all-to-all is skipped and every shape is static. In a traced
step each all-to-all is an ``ep_a2a`` span (``ep counts``, ``ep dispatch``, ``ep combine``,
and backward's ``ep dispatch grad`` / ``ep combine grad``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from fxmeg.ir import moe, moe_split
from fxmeg.ir.recomputation import Recomputation
from fxmeg.runtime import lanes
from fxmeg.runtime.groups import WeakGroup
from fxmeg.runtime.timelines import Tracer
from fxmeg.torch_private import resolve_process_group


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` in ``send`` runs to each rank; ``recv`` runs arrive from each."""

    @staticmethod
    def forward(
        ctx, x: Tensor, recv: list[int], send: list[int], exchange: AllToAllExchange, name: str,
        backward: bool = False,
    ) -> Tensor:
        ctx.recv, ctx.send, ctx.exchange, ctx.name = recv, send, exchange, name
        out = x.new_empty((sum(recv), *x.shape[1:]))
        exchange.all_to_all(name, out, x.contiguous(), recv, send, backward=backward)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = _AllToAll.apply(
            grad.contiguous(), ctx.send, ctx.recv, ctx.exchange, f"{ctx.name} grad", True
        )
        return back, None, None, None, None, None


class AllToAllExchange:
    """``moe.Exchange`` over a real expert-parallel process group."""

    group = WeakGroup()  # never holds the group alive (fxmeg/runtime/groups.py)
    twin = WeakGroup()
    """The group's twin, with a second lane (fxmeg/runtime/lanes.py), else None: backward's
    all-to-alls and a second lane's go over it."""

    def __init__(self, group: dist.ProcessGroup, twin: dist.ProcessGroup | None = None) -> None:
        self.group, self.twin = group, twin
        self.size = dist.get_world_size(group)
        self.tracer: Tracer | None = None
        """Records each all-to-all as an ``ep_a2a`` span (set by runtime/context.py)."""

    def all_to_all(self, name: str, out: Tensor, x: Tensor, recv: list[int] | None = None,
                   send: list[int] | None = None, *, backward: bool = False) -> None:
        """``all_to_all_single`` over the group, traced as ``ep <name>`` when tracing;
        ``backward``'s and a second lane's over the group's twin where it has one
        (fxmeg/runtime/lanes.py)."""
        tracer = self.tracer
        start = time.perf_counter_ns() if tracer is not None and tracer.on else 0
        twin = self.twin if backward or lanes.in_second_lane() else None
        dist.all_to_all_single(out, x, recv, send, group=twin or self.group)
        if start:
            tracer.add(f"ep {name}", "ep_a2a", start, time.perf_counter_ns())

    def dispatch(self, rows: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, object]:
        table = counts.view(self.size, -1)  # [receiver, its local expert]
        got = torch.empty_like(table)
        self.all_to_all("counts", got, table.contiguous())  # [sender, my local expert]
        send, recv = table.sum(1).tolist(), got.sum(1).tolist()
        arrived = _AllToAll.apply(rows, recv, send, self, "dispatch")  # ordered (sender, expert)
        local = got.size(1)
        expert = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(self.size), got.reshape(-1)
        )
        order = torch.argsort(expert, stable=True)  # by expert, senders in order within it
        per_expert = got.sum(0)
        return arrived[order], per_expert, (order, send, recv)

    def dispatch_padded(self, rows: Tensor, capacity: int) -> tuple[Tensor, object]:
        local = rows.shape[0] // (capacity * self.size)  # experts per rank
        send = recv = [local * capacity] * self.size
        # ordered (sender, expert), capacity rows each
        arrived = _AllToAll.apply(rows, recv, send, self, "dispatch")
        grid = torch.arange(rows.shape[0], device=rows.device).view(self.size, local, capacity)
        order = grid.transpose(0, 1).reshape(-1)  # by expert, senders in order within it
        return arrived[order], (order, send, recv)

    def combine(self, out: Tensor, state: object) -> Tensor:
        order, send, recv = state
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(out[back], send, recv, self, "combine")


class RankExperts:
    """This rank's routed experts, owned by its RankContext (``experts``): one exchange per
    expert-parallel group, made on first use, and the capacity mode's drop counts."""

    def __init__(
        self, recomputation: Recomputation | None = None, tracer: Tracer | None = None,
        twins: Mapping[str, str] | None = None,
    ) -> None:
        self.twins = dict(twins or {})
        """A group's registered name -> its twin's, with a second lane (``Groups.twins``)."""
        self.exchanges: dict[str, AllToAllExchange] = {}
        self.drops = moe.DropCounts(recomputation)
        self.tracer = tracer
        """Given to every exchange: records each all-to-all as an ``ep_a2a`` span."""

    def exchange(self, group: str) -> AllToAllExchange:
        """The exchange over the process group named ``group`` (one per group)."""
        if group not in self.exchanges:
            twin = self.twins.get(group)
            self.exchanges[group] = AllToAllExchange(
                resolve_process_group(group), twin and resolve_process_group(twin))
            self.exchanges[group].tracer = self.tracer
        return self.exchanges[group]

    @moe.as_op
    def routed_experts(self, *args, group: str, **options) -> Tensor:
        """``fxmeg.ir.ops.routed_experts`` bound: this rank's experts, the others' over
        ``group``, the drops counted in ``drops``."""
        return moe.routed_experts(*args, exchange=self.exchange(group), drops=self.drops, **options)

    @torch.compiler.disable
    def routed_experts_eager(self, *args, group: str, **options) -> Tensor:
        """``routed_experts`` outside any compiled graph: dropless experts' row counts are
        data (a compiled graph would be recompiled for each new count); a chunk graph under
        torch.compile runs its other nodes compiled and breaks the graph here, once per layer."""
        return self.routed_experts(*args, group=group, **options)

    @torch.compiler.disable
    @moe.as_op
    def routed_experts_split(self, *args, group: str, **options):
        """``fxmeg.ir.ops.routed_experts_split`` bound: ``routed_experts`` kept for a split
        backward (result, ``moe_split.SplitExperts``), outside any compiled graph as
        ``routed_experts_eager`` (traced into a compiled split forward, its state went stale:
        measured, a wrong loss from step 1)."""
        again = self.drops.recomputation.again if self.drops.recomputation else None
        return moe_split.SplitExperts.run(self.routed_experts, *args, group=group,
                                          recomputing=again or contextlib.nullcontext, **options)
