"""torch.distributed kernels of the tensor- and context-parallel ops that ``fxmeg.ir.ops`` declares,
and ``bind``, which points a chunk graph's symbolic names at this rank's real objects.

Importing this module registers the kernels; every runtime path that runs a
tensor-parallel graph imports it (``fxmeg.runtime.context``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, fx

from fxmeg.ir import ops
from fxmeg.ir.recomputation import Once, Recomputation
from fxmeg.runtime import lanes, ring_attention  # noqa: F401  (registers the cp_comm_type kernels)
from fxmeg.runtime.experts import RankExperts
from fxmeg.runtime.groups import _all_gather, _reduce_scatter


def _group(name: str) -> dist.ProcessGroup:
    return lanes.group(name)  # in a second lane, its twin


def _kernel(name: str):
    return torch.library.register_kernel(f"fxmeg::{name}", None)


@_kernel("tp_copy")
def _tp_copy(x: Tensor, group: str) -> Tensor:
    return x.clone()


@_kernel("tp_reduce")
def _tp_reduce(x: Tensor, group: str) -> Tensor:
    y = x.clone()
    dist.all_reduce(y, group=_group(group))
    return y


@_kernel("tp_max")
def _tp_max(x: Tensor, group: str) -> Tensor:
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=_group(group))
    return y


def _gathered(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    """Every rank's ``x`` end to end along ``dim``."""
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] * size, *src.shape[1:]))
    _all_gather(out, src, group=_group(group))
    return out.movedim(0, dim).contiguous()


def _own_part(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    """This rank's 1/size of ``x`` along ``dim``."""
    step = x.shape[dim] // size
    return x.narrow(dim, dist.get_rank(_group(group)) * step, step).clone()


torch.library.register_kernel("fxmeg::sp_gather", None, _gathered)
torch.library.register_kernel("fxmeg::sp_whole", None, _gathered)
torch.library.register_kernel("fxmeg::tp_slice", None, _own_part)
torch.library.register_kernel("fxmeg::sp_split", None, _own_part)


@_kernel("sp_scatter")
def _sp_scatter(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // size, *src.shape[1:]))
    _reduce_scatter(out, src, group=_group(group))
    return out.movedim(0, dim).contiguous()


@_kernel("tp_pad")
def _tp_pad(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] *= size
    out = x.new_zeros(shape)
    step = x.shape[dim]
    out.narrow(dim, dist.get_rank(_group(group)) * step, step).copy_(x)
    return out


@_kernel("vocab_shard_ids")
def _vocab_shard_ids(ids: Tensor, rows: int, group: str) -> tuple[Tensor, Tensor]:
    """Ids relative to this rank's rows [rank * rows, (rank + 1) * rows), 0 outside them."""
    start = dist.get_rank(_group(group)) * rows
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill(outside, 0), outside


@_kernel("vocab_parallel_cross_entropy")
def _vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int, group: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token loss over logits (N, V / tp) holding this rank's vocabulary rows;
    ignored targets lose 0. Also the local softmax and each target's local column (-1
    where another rank holds it), which backward needs."""
    pg = _group(group)
    x = logits.float()
    top = x.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=pg)
    x = x - top.unsqueeze(-1)
    local = target - dist.get_rank(pg) * x.shape[-1]
    mine = (local >= 0) & (local < x.shape[-1]) & (target != ignore_index)
    picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
    exp = x.exp()
    total = exp.sum(dim=-1)
    dist.all_reduce(picked, group=pg)
    dist.all_reduce(total, group=pg)
    loss = (total.log() - picked).masked_fill(target == ignore_index, 0.0)
    return loss, exp / total.unsqueeze(-1), local.masked_fill(~mine, -1)


# ---------------------------------------------------------------- context parallel


def _rank_major(seq: int, size: int, device: torch.device) -> Tensor:
    """The global position of every row of an all-gather of the ranks' parts (rank 0's
    rows, then rank 1's ...)."""
    return torch.tensor(
        [p for r in range(size) for p in ops.cp_positions(seq, size, r)], device=device
    )


def _cp_slice(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    rank = dist.get_rank(_group(group))
    index = torch.tensor(ops.cp_positions(x.shape[dim], size, rank), device=x.device)
    return x.index_select(dim, index)


def _cp_unslice(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    rank = dist.get_rank(_group(group))
    index = torch.tensor(ops.cp_positions(x.shape[dim] * size, size, rank), device=x.device)
    shape = list(x.shape)
    shape[dim] *= size
    return x.new_zeros(shape).index_copy(dim, index, x)


def _cp_gather(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] * size, *src.shape[1:]))
    _all_gather(out, src, group=_group(group))
    order = _rank_major(out.shape[0], size, x.device)  # row i holds global position order[i]
    full = torch.empty_like(out).index_copy_(0, order, out)
    return full.movedim(0, dim).contiguous()


def _cp_reduce_scatter(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    src = x.movedim(dim, 0)
    src = src.index_select(0, _rank_major(src.shape[0], size, x.device)).contiguous()
    out = src.new_empty((src.shape[0] // size, *src.shape[1:]))
    _reduce_scatter(out, src, group=_group(group))
    return out.movedim(0, dim).contiguous()


def _cp_all_reduce(x: Tensor, group: str) -> Tensor:
    y = x.clone()
    dist.all_reduce(y, group=_group(group))
    return y


def _cp_causal_mask(q: Tensor, dim: int, size: int, group: str) -> Tensor:
    local = q.shape[dim]
    rank = dist.get_rank(_group(group))
    rows = torch.tensor(ops.cp_positions(local * size, size, rank), device=q.device)
    keys = torch.arange(local * size, device=q.device)
    return rows.unsqueeze(1) >= keys.unsqueeze(0)  # (local queries, all keys)


def _cp_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None, enable_gqa: bool, size: int,
                  group: str) -> Tensor:
    dim = q.dim() - 2  # (..., heads, seq, head_dim)
    keys, values = _cp_gather(k, dim, size, group), _cp_gather(v, dim, size, group)
    mask = _cp_causal_mask(q, dim, size, group)
    # contiguous, as the op's fake says: the CPU flash kernel (where the CPU has one)
    # returns (batch, seq, heads, dim) memory, which inductor's stride check refuses
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    ).contiguous()


def _cp_attention_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    enable_gqa: bool,
    size: int,
    group: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention's backward from the probabilities recomputed in fp32 (FlashAttention's
    backward: dS = P * (dP - rowsum(dP * P))), K and V gathered again, dK and dV
    reduce-scattered back to the ranks that hold those positions."""
    dim = q.dim() - 2
    keys, values = _cp_gather(k, dim, size, group), _cp_gather(v, dim, size, group)
    mask = _cp_causal_mask(q, dim, size, group)
    rep = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    kf, vf = (
        t.repeat_interleave(rep, dim=-3).float() if rep > 1 else t.float() for t in (keys, values)
    )
    qf, g = q.float(), grad.float()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (qf @ kf.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)  # (..., local queries, all keys)
    dv = probs.transpose(-2, -1) @ g
    dprobs = g @ vf.transpose(-2, -1)
    dscores = probs * (dprobs - (dprobs * probs).sum(dim=-1, keepdim=True)) * scale
    dq = dscores @ kf
    dk = dscores.transpose(-2, -1) @ qf
    if rep > 1:  # a KV head served rep query heads: its gradient is their sum
        dk, dv = (t.unflatten(-3, (t.shape[-3] // rep, rep)).sum(dim=-3) for t in (dk, dv))
    dk = _cp_reduce_scatter(dk.to(k.dtype), dim, size, group)
    dv = _cp_reduce_scatter(dv.to(v.dtype), dim, size, group)
    return dq.to(q.dtype), dk, dv


# plain functions first: the attention kernels call the gather, mask and scatter ones
for _name in (
    "cp_slice",
    "cp_unslice",
    "cp_gather",
    "cp_reduce_scatter",
    "cp_all_reduce",
    "cp_causal_mask",
    "cp_attention",
    "cp_attention_backward",
):
    _kernel(_name)(globals()[f"_{_name}"])


# ---------------------------------------------------------------- per-tp-rank random stream

TP_RNG_OFFSET = 2718
"""Megatron's offset of the model-parallel seed (``model_parallel_cuda_manual_seed``)."""


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def _device(x) -> torch.device:
    while isinstance(x, (tuple, list)):
        x = x[0]
    return x.device


class TpRandom:
    """This rank's per-tp-rank random streams (one per RankContext, through its
    ``Binding``): what ``ops.tp_rng_fork`` / ``tp_rng_join`` are bound to, and the states
    of the default streams they left (a stack: forks nest)."""

    def __init__(self) -> None:
        self._forks: list[tuple[torch.Generator, torch.Tensor]] = []

    def tp_rng_fork(self, x, *, group: str):
        """Switch ``x``'s device's default generator to this tp rank's stream: one number s is
        drawn from the default CPU stream (it advances the same on every rank), the default
        state after it is kept, and the generator is seeded with s + 2718 + tp rank. The
        per-rank stream is thus a function of the default stream: where the default stream
        is replayed (torch.utils.checkpoint restores it before recompute), so are the
        per-rank masks; ranks differ by their seed, so no two ranks share a mask."""
        gen = _generator(_device(x))
        # s comes from the CPU stream (no device sync; checkpoint replays it on every device)
        s = int(torch.randint(0, 2**62, (1,), generator=torch.default_generator))
        self._forks.append((gen, gen.get_state()))
        gen.manual_seed(s + TP_RNG_OFFSET + dist.get_rank(_group(group)))
        return x

    def tp_rng_join(self, y, *, group: str):
        """Back to the default stream where ``tp_rng_fork`` left it."""
        gen, state = self._forks.pop()
        gen.set_state(state)
        return y


@dataclass(frozen=True)
class Binding:
    """What ``bind`` points a chunk graph's ops at on this rank; a marker whose field is None
    stays unbound (a no-op, or its one-process meaning)."""

    groups: dict[str, str]
    """Symbolic group names ('tp', 'cp', 'ep', 'dp') -> this rank's process groups' names."""
    wait_param_gather: Callable[..., None] | None = None
    """``ops.wait_param_gather``: the data-parallel buffers' wait (overlap_param_gather)."""
    zero: tuple[Callable[..., None], Callable[..., None]] | None = None
    """``ops.zero_gather`` and ``ops.zero_release`` (zero=3)."""
    early_linear: Callable[..., torch.Tensor] | None = None
    """``ops.early_linear`` (zero >= 2: ``DataParallel.early_linear``)."""
    expert_load: Callable[..., None] | None = None
    """``ops.expert_load``: the tokens-per-expert recorder (runtime/expert_load.py)."""
    global_tokens: Callable[..., torch.Tensor] | None = None
    """``ops.global_tokens``: the running tokens per expert."""
    device: torch.device | None = None
    """Where a capacity-mode routed-experts layer's dropped-pairs counter lives."""
    experts: RankExperts | None = None
    """``ops.routed_experts``: this rank's experts (the exchanges, the drop counts)."""
    recomputation: Recomputation | None = None
    """Given to every recompute region (``passes/recompute.py``'s ``Recompute``)."""
    rng: TpRandom = field(default_factory=TpRandom)
    """``ops.tp_rng_fork`` / ``tp_rng_join``: this rank's per-tp-rank streams."""

    def group(self, name: str) -> str:
        """The real group's name for a symbolic one (other names unchanged)."""
        return self.groups.get(name, name)


Binder = Callable[[fx.Node, Binding], None]


def _bind_rng(node: fx.Node, b: Binding) -> None:
    node.target = b.rng.tp_rng_fork if node.target is ops.tp_rng_fork else b.rng.tp_rng_join
    node.kwargs = {**node.kwargs, "group": b.group(node.kwargs["group"])}


def _bind_collective(node: fx.Node, b: Binding) -> None:
    node.args = tuple(b.group(a) if isinstance(a, str) else a for a in node.args)


def _bind_routed_experts(node: fx.Node, b: Binding) -> None:
    if node.kwargs["group"] not in b.groups or b.experts is None:
        return
    if node.target is ops.routed_experts_split:  # a zero-bubble split's forward graph
        node.target = b.experts.routed_experts_split
    elif node.kwargs.get("capacity_factor") is None:  # dropless: outside compiled graphs
        node.target = b.experts.routed_experts_eager
    else:
        node.target = b.experts.routed_experts
    kwargs = {**node.kwargs, "group": b.groups[node.kwargs["group"]]}
    if kwargs.get("down_sum") is not None:  # expert tp's sum before a down bias
        kwargs["down_sum"] = b.group(kwargs["down_sum"])
    node.kwargs = kwargs
    if node.kwargs.get("capacity_factor") is not None and b.device is not None:
        # before any (compiled) forward
        b.experts.drops.track(node.kwargs.get("layer", ""), b.device)


def _bind_zero(node: fx.Node, b: Binding) -> None:
    if b.zero is not None:
        node.target = b.zero[node.target is ops.zero_release]


def _bind_global_tokens(node: fx.Node, b: Binding) -> None:
    """The running tokens per expert advance once per micro-batch: a recompute region that
    reads them gets the value its forward got (``Recomputation.once``), not a second step."""
    if b.global_tokens is not None:
        node.target = (
            b.global_tokens if b.recomputation is None
            else Once(b.global_tokens, b.recomputation).call
        )
        node.kwargs = {**node.kwargs, "group": b.group(node.kwargs["group"])}


def _bind_to(field_name: str) -> Binder:
    """A marker that becomes ``Binding.<field_name>`` where that is set."""

    def binder(node: fx.Node, b: Binding) -> None:
        target = getattr(b, field_name)
        if target is not None:
            node.target = target

    return binder


BINDERS: Mapping[Callable, Binder] = MappingProxyType({
    ops.tp_rng_fork: _bind_rng,
    ops.tp_rng_join: _bind_rng,
    **{op: _bind_collective for op in ops.COLLECTIVES},
    ops.routed_experts: _bind_routed_experts,
    ops.routed_experts_split: _bind_routed_experts,
    ops.wait_param_gather: _bind_to("wait_param_gather"),
    ops.zero_gather: _bind_zero,
    ops.zero_release: _bind_zero,
    ops.early_linear: _bind_to("early_linear"),
    ops.expert_load: _bind_to("expert_load"),
    ops.global_tokens: _bind_global_tokens,
})
"""Each op ``bind`` rewrites -> how (one entry per op)."""


def bind(gm: fx.GraphModule, binding: Binding) -> None:
    """Point ``gm`` (and the graphs of its submodules, e.g. recompute regions) at this
    rank's objects (``binding``), each op by its entry of ``BINDERS``: symbolic group names
    (``"tp"``) become the real process groups' names, ``ops.tp_rng_fork`` / ``tp_rng_join``
    switch to this rank's random stream, the markers call this rank's functions, the
    recompute regions share this rank's ``Recomputation``, and a routed experts layer with a
    capacity factor gets its dropped-pairs counter on ``binding.device``. Only arguments and call
    targets change; the graph's structure does not."""
    for module in gm.modules():
        if (
            isinstance(getattr(module, "recomputation", None), Recomputation)
            and binding.recomputation is not None
        ):
            module.recomputation = binding.recomputation  # a recompute region (passes/recompute.py)
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            binder = BINDERS.get(node.target) if node.op == "call_function" else None
            if binder is not None:
                binder(node, binding)
        module.recompile()
