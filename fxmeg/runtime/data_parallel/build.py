"""This rank's data parallelism, built from the Program: one gradient buffer per chunk and
gradient dtype (a ZeRO-2/3 one at those stages; the experts' own over the expert-data-parallel
group), and the all-reduces a parameter's gradient needs beyond them (tied parameters held by
several pipeline ranks, replicated ones whose gradient differs per tp rank)."""

from __future__ import annotations

from torch import fx, nn

from fxmeg.config_sections import DataParallelConfig
from fxmeg.ir.layouts import reduces_grad
from fxmeg.ir.program import Program
from fxmeg.runtime.data_parallel.ddp import DataParallel, Events, GradBuffer
from fxmeg.runtime.data_parallel.zero import ShardFill, ZeroBuffer
from fxmeg.runtime.groups import Groups
from fxmeg.runtime.timelines import Tracer


def data_parallel(
    program: Program,
    options: DataParallelConfig,
    chunks,
    groups: Groups,
    tracer: Tracer,
    fill: ShardFill | None = None,
    *,
    shard: bool,
) -> DataParallel:
    events = Events()
    deferred = frozenset(n for n, h in program.holders.items() if len(h) > 1)
    def buffer(c: int, gm: fx.GraphModule, layout) -> GradBuffer:
        common = dict(
            label=f"chunk{c}" + ("/experts" if layout.experts else ""),
            group=groups.edp if layout.experts else groups.dp_cp,
            overlap=options.overlap_grad_reduce,
            events=events,
            deferred=deferred,
            tracer=tracer,
        )
        if options.zero_stage >= 2:
            return ZeroBuffer(
                layout,
                dict(gm.named_parameters()),
                stage=options.zero_stage,
                fill=fill,
                lean=options.backward_prefetch == "post",
                **common,
            )
        return GradBuffer(layout, dict(gm.named_parameters()), shard=shard, **common)

    buffers = {
        c: [buffer(c, gm, layout) for layout in program.buffers[c]] for c, gm in chunks.items()
    }
    return DataParallel(buffers, events)


def grad_reductions(
    program: Program, named: dict[str, nn.Parameter], groups: Groups
) -> list[tuple[nn.Parameter, str | None]]:
    """(parameter, the name of the group that all-reduces its gradient, None for one rank):
    tied weights over their pipeline ranks, then tp-replicated ones over tp. By name, as
    fxmeg holds every group (fxmeg/runtime/groups.py, ``WeakGroup``)."""
    names = sorted(named)  # every holder issues these all-reduces in the same order
    tied = [
        (named[n], groups.tied[frozenset(program.holders[n])])
        for n in names
        if len(program.holders[n]) > 1
    ]
    replicated = [(named[n], groups.tp) for n in names if reduces_grad(program.tp_specs.get(n))]
    return [(p, None if g is None else g.group_name) for p, g in tied + replicated]
