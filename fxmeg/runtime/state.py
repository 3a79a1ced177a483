"""The state mapping between this rank's runtime and the user model's names
(docs/architecture.md §6): the full state dict, and the boxes of every parameter and
optimizer state this rank holds, which checkpoints save and load. Reads the Program
and the RankContext only.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import fx

from fxmeg.ir.program import Program
from fxmeg.runtime.context import RankContext
from fxmeg.runtime.groups import all_gather_
from fxmeg.runtime.optimizer.layerwise import gather_tp
from fxmeg.weights.sharding import Pieces, flat_index, flat_to_boxes, local_to_global, view


def gather_full_state(program: Program, ctx: RankContext) -> dict[str, torch.Tensor]:
    """The user model's state_dict with the current trained values on every rank:
    tensor-parallel shards are all-gathered, each pipeline stage's parameters broadcast
    from their first holder. Collective."""
    ctx.ddp.wait_for_params()
    canonical = {n: c for c, names in program.aliases.items() for n in names}
    out: dict[str, torch.Tensor] = {}
    with ctx.unsharded():
        for key in program.full_shapes:  # the user's state_dict order
            name = canonical.get(key, key)
            if name not in program.holders:  # not trained by any chunk: the model's own value
                out[key] = program.untrained[key].clone()
                continue
            local = ctx.named_parameters.get(name)
            out[key] = gather_full(
                program,
                ctx,
                name,
                local.detach() if local is not None else None,
                program.full_shapes[key][1],
            )
    return out


def gather_full_grads(program: Program, ctx: RankContext) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient as the gradient buffers hold it, whole, in
    fp32, on every rank, by canonical FQN in graph order (``graph_order``): reduced over
    micro-batches and data-parallel ranks and divided by the global token count, as the
    last forward-backward left it: read it before the optimizer step, which clips in
    place what this rank updates. Parameters no chunk reads (``Program.unread``) have
    none. Collective."""
    local: dict[str, torch.Tensor] = {}
    for buf in ctx.ddp.all():
        data = buf.local_grads()
        if buf.shard:  # reduce-scattered: each data-parallel rank holds its part of a bucket
            data = data.clone()
            for b in buf.layout.buckets:
                work = all_gather_(data[b.start : b.end], buf.group)
                if work is not None:
                    work.wait()
        for s in buf.layout.slots:
            local[s.name] = data[s.offset : s.offset + s.numel].view(buf.params[s.name].shape)
    return {
        name: gather_full(
            program, ctx, name, local[name].float() if name in local else None, torch.float32
        )
        for name, _, _ in graph_order(program)
    }


def graph_order(program: Program) -> list[tuple[str, int, fx.Node]]:
    """(parameter, chunk, get_attr node) of each trainable parameter at its first read."""
    seen, out = set(), []
    for c, gm in enumerate(program.chunks):
        for node in gm.graph.nodes:
            if (
                node.op == "get_attr"
                and node.target in program.parameters
                and node.target not in seen
            ):
                seen.add(node.target)
                out.append((node.target, c, node))
    return out


def gather_full(program: Program, ctx: RankContext, name: str, local: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """The full tensor of trainable parameter ``name`` (or of anything laid out like it,
    e.g. its gradient) on every rank, from ``local``, this rank's tensor-parallel shard
    of it (read only on the parameter's first pipeline holder): the tp shards are
    all-gathered there, then broadcast over the pipeline. Collective."""
    groups = ctx.groups
    owner = min(program.holders[name])
    if owner == groups.pp_rank:
        value = gather_tp(local, program.tp_specs.get(name), groups.tp)
        if name in program.ep_specs and groups.ep is not None:  # every ep rank's experts, in order
            banks = [torch.empty_like(value) for _ in range(dist.get_world_size(groups.ep))]
            dist.all_gather(banks, value.contiguous(), group=groups.ep)
            value = torch.cat(banks)
    else:
        value = torch.empty(program.parameters[name].shape, dtype=dtype, device=ctx.device)
    if groups.pp is not None:
        dist.broadcast(value, groups.pp_peer(owner), group=groups.pp)
    return value


# ---------------------------------------------------------------- this rank's state


def _full_shape(program: Program, name: str) -> torch.Size:
    return program.full_shapes[name][0]


def _expert_offset(program: Program, ctx: RankContext, name: str) -> int:
    """Where this rank's experts of bank ``name`` start along dim 0 (0 if not a bank)."""
    spec = program.ep_specs.get(name)
    return spec.experts_of(ctx.config.parallel.ep, ctx.groups.ep_rank)[0] if spec is not None else 0


def _moved(offsets: tuple[int, ...], dim0: int) -> tuple[int, ...]:
    """Global box offsets moved ``dim0`` rows along dim 0 (an ep rank's experts)."""
    return (offsets[0] + dim0, *offsets[1:]) if dim0 else offsets


def model_entries(program: Program, ctx: RankContext) -> dict[str, Pieces]:
    """``model/<fqn>`` for every parameter this rank's chunks train (its boxes), and,
    whole, for what no chunk trains: persistent buffers, unused parameters."""
    tp, rank = ctx.config.parallel.tp, ctx.groups.tp_rank
    out = {}
    for name, p in ctx.named_parameters.items():
        local = ((0,) * p.dim(), tuple(p.shape))
        spec = program.tp_specs.get(name)
        shift = _expert_offset(program, ctx, name)
        parts = [
            (_moved(g[0], shift), view(p.detach(), l))
            for g, l in local_to_global(local, spec, tp, rank)
        ]
        out[f"model/{name}"] = Pieces(_full_shape(program, name), parts)
    for name in program.aliases:
        if name not in program.holders and name in program.untrained:
            t = program.untrained[name]
            out[f"model/{name}"] = Pieces(t.shape, [((0,) * t.dim(), t)])
    return out


def optimizer_entries(
    program: Program, ctx: RankContext, saved: set[str] | None = None
) -> dict[str, Pieces]:
    """``optim/<state>/<fqn>`` for the elements this rank's optimizer updates. ``saved``
    (on load: the checkpoint's ``optim/<state>/<fqn>`` entries) says which states each
    parameter has; they are created as zeros where missing (several inner optimizers keep
    different states: Muon a momentum buffer, AdamW two moments)."""
    opt = ctx.optimizer
    tp, rank = ctx.config.parallel.tp, ctx.groups.tp_rank
    wanted: dict[str, set[str]] = {}
    for entry in saved or ():
        _, key, fqn = entry.split("/", 2)
        wanted.setdefault(fqn, set()).add(key)
    out: dict[str, Pieces] = {}
    for piece in opt.pieces:
        state = opt.inner.state.setdefault(piece.master, {})
        keys = wanted.get(piece.name, set())
        for key in keys:
            if key != "master" and key not in state:
                state[key] = torch.zeros_like(piece.master)
        tensors = {
            k: v
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.numel() == piece.master.numel() and v.dim() > 0
        }
        if piece.param.dtype != torch.float32:  # half precision: the fp32 master is state too
            tensors["master"] = piece.master
        if saved is not None:
            tensors = {k: v for k, v in tensors.items() if k in keys}
        full = piece.spec is not None  # a full matrix: its boxes are the full tensor's own
        shape = tuple(piece.master.shape) if full else tuple(piece.param.shape)
        spec = None if full else program.tp_specs.get(piece.name)
        shift = _expert_offset(program, ctx, piece.name)
        for key, t in tensors.items():
            flat = t.detach().reshape(-1)
            entry = out.setdefault(
                f"optim/{key}/{piece.name}", Pieces(_full_shape(program, piece.name), [])
            )
            for box in flat_to_boxes(shape, piece.lo, piece.hi):
                start = flat_index(shape, box[0]) - piece.lo
                box_view = flat[start : start + math.prod(box[1])].view(box[1])
                for g, l in local_to_global(box, spec, tp, rank):
                    rel = tuple(a - b for a, b in zip(l[0], box[0]))
                    entry.parts.append((_moved(g[0], shift), view(box_view, (rel, l[1]))))
    return out


def scalars(ctx: RankContext) -> dict[str, float]:
    """Scalar optimizer states (Adam's step), the same for every parameter that has them
    (all inner optimizers step together), from every state on this rank."""
    out: dict[str, float] = {}
    for state in ctx.optimizer.inner.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() == 0:
                out.setdefault(k, float(v))
    return out


def layout(ctx: RankContext) -> dict:
    par, dp = ctx.config.parallel, ctx.config.data_parallel
    return {"tp": par.tp, "cp": par.cp, "pp": par.pp, "vpp": par.vpp, "dp": par.dp, "ep": par.ep,
            "distributed_optimizer": dp.distributed_optimizer, "zero": dp.zero_stage,
            "optimizer_sharding": ctx.optimizer.sharding,
            "precision": ctx.config.precision}


def model_signature(program: Program) -> dict[str, list[int]]:
    return {k: list(shape) for k, (shape, _) in program.full_shapes.items()}


# ---------------------------------------------------------------- save


