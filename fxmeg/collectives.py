"""Tensor-parallel collectives as registered ops (namespace ``fxmeg``) with autograd.

They show by name in printed graphs (``torch.ops.fxmeg.tp_copy.default``) and trace
through torch.compile. Each takes the *name* of a process group: passes write the
symbolic name ``"tp"`` (they run before any process group exists) and the runtime binds
the real group's name with ``bind_groups``.

  tp_copy   Megatron's f: identity forward, all-reduce of the gradient
  tp_reduce Megatron's g: all-reduce forward, identity backward
  sp_gather all-gather along a (sequence) dim forward, reduce-scatter backward
  sp_scatter reduce-scatter along a dim forward, all-gather backward
            (both also take the group's size, so shapes are known without a group)
  vocab_parallel_cross_entropy  per-token loss over vocabulary-sharded logits (Megatron's
            _VocabParallelCrossEntropy); the full logits are never gathered
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor, fx

from fxmeg.runtime.groups import _all_gather, _reduce_scatter

TP = "tp"  # symbolic group name in graphs before binding


def _group(name: str) -> dist.ProcessGroup:
    return c10d._resolve_process_group(name)


@torch.library.custom_op("fxmeg::tp_copy", mutates_args=())
def tp_copy(x: Tensor, group: str) -> Tensor:
    return x.clone()


@torch.library.custom_op("fxmeg::tp_reduce", mutates_args=())
def tp_reduce(x: Tensor, group: str) -> Tensor:
    y = x.clone()
    dist.all_reduce(y, group=_group(group))
    return y


@torch.library.custom_op("fxmeg::sp_gather", mutates_args=())
def sp_gather(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    pg = _group(group)
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] * size, *src.shape[1:]))
    _all_gather(out, src, group=pg)
    return out.movedim(0, dim).contiguous()


@torch.library.custom_op("fxmeg::sp_scatter", mutates_args=())
def sp_scatter(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    pg = _group(group)
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // size, *src.shape[1:]))
    _reduce_scatter(out, src, group=pg)
    return out.movedim(0, dim).contiguous()


@tp_copy.register_fake
@tp_reduce.register_fake
def _same_shape(x, group):
    return torch.empty_like(x)


@sp_gather.register_fake
def _gathered(x, dim, size, group):
    shape = list(x.shape)
    shape[dim] *= size
    return x.new_empty(shape)


@sp_scatter.register_fake
def _scattered(x, dim, size, group):
    shape = list(x.shape)
    shape[dim] //= size
    return x.new_empty(shape)


def _keep_args(ctx, inputs, output):
    ctx.args = inputs[1:]


tp_copy.register_autograd(lambda ctx, g: (tp_reduce(g, *ctx.args), None), setup_context=_keep_args)
tp_reduce.register_autograd(lambda ctx, g: (g, None), setup_context=_keep_args)
sp_gather.register_autograd(lambda ctx, g: (sp_scatter(g, *ctx.args), None, None, None), setup_context=_keep_args)
sp_scatter.register_autograd(lambda ctx, g: (sp_gather(g, *ctx.args), None, None, None), setup_context=_keep_args)


@torch.library.custom_op("fxmeg::vocab_parallel_cross_entropy", mutates_args=())
def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int, group: str
) -> tuple[Tensor, Tensor]:
    """(per-token loss, softmax of this rank's logits) for logits (N, V / tp) holding
    vocabulary rows [vocab_start, vocab_start + V / tp); ignored targets lose 0."""
    pg = _group(group)
    x = logits.float()
    top = x.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=pg)
    x = x - top.unsqueeze(-1)
    local = target - vocab_start
    mine = (local >= 0) & (local < x.shape[-1]) & (target != ignore_index)
    picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
    exp = x.exp()
    total = exp.sum(dim=-1)
    dist.all_reduce(picked, group=pg)
    dist.all_reduce(total, group=pg)
    loss = (total.log() - picked).masked_fill(target == ignore_index, 0.0)
    return loss, exp / total.unsqueeze(-1)


@vocab_parallel_cross_entropy.register_fake
def _vpce_fake(logits, target, vocab_start, ignore_index, group):
    return logits.new_empty(target.shape, dtype=torch.float32), logits.new_empty(logits.shape, dtype=torch.float32)


def _vpce_setup(ctx, inputs, output):
    logits, target, vocab_start, ignore_index, _ = inputs
    ctx.save_for_backward(output[1], target)
    ctx.vocab_start, ctx.ignore_index, ctx.dtype = vocab_start, ignore_index, logits.dtype


def _vpce_backward(ctx, grad_loss, _grad_softmax):
    softmax, target = ctx.saved_tensors
    g = grad_loss.masked_fill(target == ctx.ignore_index, 0.0).unsqueeze(-1)
    grad = softmax * g
    local = target - ctx.vocab_start
    mine = (local >= 0) & (local < softmax.shape[-1]) & (target != ctx.ignore_index)
    rows = mine.nonzero().squeeze(-1)
    grad[rows, local[rows]] -= g[rows, 0]
    return grad.to(ctx.dtype), None, None, None, None


vocab_parallel_cross_entropy.register_autograd(_vpce_backward, setup_context=_vpce_setup)

OPS = {
    torch.ops.fxmeg.tp_copy.default,
    torch.ops.fxmeg.tp_reduce.default,
    torch.ops.fxmeg.sp_gather.default,
    torch.ops.fxmeg.sp_scatter.default,
    torch.ops.fxmeg.vocab_parallel_cross_entropy.default,
}


def bind_groups(gm: fx.GraphModule, names: dict[str, str]) -> None:
    """Replace symbolic group names (e.g. "tp") in every collective node with the real
    process groups' names, then regenerate the code."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in OPS:
            node.args = tuple(names.get(a, a) if isinstance(a, str) else a for a in node.args)
    gm.recompile()
