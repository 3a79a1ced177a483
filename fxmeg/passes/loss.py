"""Loss pass: the model's mean loss becomes ``(loss_sum, num_tokens)``.

Requires: a captured graph (``fxmeg.frontend.capture``) whose first output is the model's scalar
loss, or, with a user ``loss_fn``, whose outputs are ``(loss_sum, num_tokens)``.
Ensures: the graph returns exactly ``(loss_sum, num_tokens)``, two scalars with
``loss_sum / num_tokens`` equal to the original loss; ``num_tokens`` does not depend on
parameters. Extra model outputs are dropped. The two output nodes carry
``meta["fxmeg"]["loss"] = "sum" | "count"``.

An auxiliary (router) loss goes through ``fxmeg::scale_aux_loss``, out of the token
weighting. Why the pair, and how an autocast-disabled loss, half-precision logits and the
auxiliary loss are handled: docs/architecture.md §8.6.

Recognised forms of the mean (through casts, clones and scalar views):
  cross_entropy / nll_loss, reduction='mean', no class weights -> reduction='sum',
      num_tokens = count of targets != ignore_index;
  sum(x) / sum(w) (e.g. ``(l * mask).sum() / mask.sum().clamp(min=1)``) -> sum(x), sum(w);
  x.mean() over all elements -> x.sum(), x.numel().
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxmeg.errors import PassError
from fxmeg.ir import ops
from fxmeg.ir.tags import set_tag, tag
from fxmeg.passes.graph_utils import (
    arg,
    attr,
    call,
    fake_eval,
    finish,
    full_args,
    inline,
    is_hop,
    val,
)
from fxmeg.torch_private import detect_fake_mode, op_schema

aten = torch.ops.aten

_CLASS_LOSSES = {
    # target: (index of the reduction argument, index of ignore_index)
    aten.cross_entropy_loss.default: (3, 4),
    aten.nll_loss_nd.default: (3, 4),
    aten.nll_loss.default: (3, 4),
    aten.nll_loss2d.default: (3, 4),
}
_TRANSPARENT = {  # unary ops that commute with "divide by the token count"
    aten.clone.default,
    aten.alias.default,
    aten.view.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.to.dtype,
    aten._to_copy.default,
}
_MEAN, _SUM = 1, 2  # ATen reduction enum


def loss(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite the first output (a mean loss) into ``(loss_sum, num_tokens)``.

    When capture recorded a user ``loss_fn`` the outputs already are ``(loss_sum,
    num_tokens)``; they are only checked and tagged.
    """
    out = gm.graph.output_node()
    outputs = out.args[0]
    if tag(gm, "capture").explicit_loss:
        if len(outputs) != 2 or not all(_is_scalar(n) for n in outputs):
            raise PassError(
                "loss_fn must return (loss_sum, num_tokens), two scalar tensors; got "
                f"{len(outputs)} output(s) with shapes {[_shape(n) for n in outputs]}"
            )
        loss_sum, num_tokens = outputs
    else:
        _out_of_region(outputs[0])
        outputs = out.args[0]
        loss_sum, num_tokens = _rewrite_mean(gm, outputs[0])
    if _depends_on_parameters(num_tokens):
        raise PassError(
            f"num_tokens (node {num_tokens.name!r}) depends on parameters; the token "
            "count must come from the inputs (labels or a mask)"
        )
    set_tag(loss_sum, "loss", "sum")
    set_tag(num_tokens, "loss", "count")
    old = outputs[0]
    out.args = ((loss_sum, num_tokens),)
    if old not in (loss_sum, num_tokens) and not old.users:
        gm.graph.erase_node(old)  # an in-place `loss += aux` that DCE would keep
    return finish(gm)


def _rewrite_mean(gm: fx.GraphModule, loss_node: fx.Node) -> tuple[fx.Node, fx.Node]:
    graph = gm.graph
    if not _is_scalar(loss_node):
        raise PassError(
            f"the model's first output (node {loss_node.name!r}) has shape "
            f"{_shape(loss_node)}, not a scalar loss. Return the mean loss, or pass "
            "loss_fn=lambda model, *batch: (loss_sum, num_tokens)."
        )
    main, aux = _split_aux(loss_node)
    if aux is not None:
        loss_sum, num_tokens = _rewrite_mean(gm, main)
        gm.register_buffer(ops.AUX_SCALE, torch.ones((), dtype=torch.float32), persistent=False)
        with graph.inserting_before(loss_node):
            scale = graph.get_attr(ops.AUX_SCALE)
            scale.meta = {"val": _fake_scalar(loss_sum), "fxmeg": {"module": ""}}
            loss_sum = call(graph, torch.ops.fxmeg.scale_aux_loss.default, (loss_sum, aux, scale),
                            like=loss_node, name="loss_with_aux")
        return loss_sum, num_tokens
    top, mean = loss_node, loss_node
    while mean.op == "call_function" and mean.target in _TRANSPARENT:
        mean = mean.args[0]
    with graph.inserting_after(mean):
        if mean.target in _CLASS_LOSSES:
            loss_sum, num_tokens = _class_loss(graph, mean)
        elif mean.target == aten.div.Tensor and _is_ratio_of_sums(mean):
            loss_sum, num_tokens = mean.args[0], _unclamped(mean.args[1])
        elif mean.target == aten.mean.default or _is_full_mean_dim(mean):
            loss_sum, num_tokens = _plain_mean(graph, mean)
        else:
            raise PassError(_unrecognised(mean))
    if loss_sum is not mean:
        mean.replace_all_uses_with(loss_sum)
    if top is not mean:  # keep the casts and views, now applied to the sum
        loss_sum = top
    return loss_sum, num_tokens


def _out_of_region(loss_node: fx.Node) -> None:
    """Inline the region that computes the loss when it is autocast-disabled (``with
    torch.autocast(..., enabled=False)``, for an fp32 loss): fxmeg never runs forward under
    autocast, so the region changes nothing. Other regions stay (``_unrecognised`` names
    them)."""
    core = loss_node
    while core.op == "call_function" and core.target in _TRANSPARENT:
        core = core.args[0]
    if core.target is operator.getitem and is_hop(core.args[0]):
        region = core.args[0]
        if region.target.name() == "wrap_with_autocast" and not region.args[2]:
            inline(region)


def _split_aux(node: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(mean, aux) for ``mean + aux`` where one side is a recognised mean and the other
    does not read it; (node, None) otherwise."""
    if node.target not in (aten.add.Tensor, aten.add_.Tensor) or len(node.args) != 2:
        return node, None
    for main, aux in (node.args, node.args[::-1]):
        core = main
        while (
            isinstance(core, fx.Node) and core.op == "call_function" and core.target in _TRANSPARENT
        ):
            core = core.args[0]
        if isinstance(core, fx.Node) and isinstance(aux, fx.Node) and _is_scalar(aux) and (
            core.target in _CLASS_LOSSES or core.target == aten.mean.default
        ):
            return main, aux
    return node, None


def _fake_scalar(like: fx.Node):
    with detect_fake_mode([like.meta["val"]]):
        return torch.ones((), dtype=torch.float32)


def _class_loss(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, fx.Node]:
    red_idx, ign_idx = _CLASS_LOSSES[node.target]
    name = op_schema(node.target).name
    if arg(node, red_idx, "reduction", _MEAN) != _MEAN:
        raise PassError(
            f"{name} (node {node.name!r}) does not use reduction='mean'; fxmeg rewrites "
            "a mean loss. Return the mean, or pass loss_fn returning (loss_sum, num_tokens)."
        )
    if arg(node, 2, "weight") is not None:
        raise PassError(
            f"{name} (node {node.name!r}) uses class weights; the token-weighted mean of "
            "a weighted loss is not a plain count. Pass loss_fn returning "
            "(loss_sum, num_tokens) with your own weighting."
        )
    target = node.args[1]
    if val(target) is not None and val(target).is_floating_point():
        raise PassError(
            f"{name} (node {node.name!r}) has probability targets; pass loss_fn returning "
            "(loss_sum, num_tokens)."
        )
    args = full_args(node)
    ignore_index = args[ign_idx]
    args[red_idx] = _SUM
    if val(args[0]).dtype in (torch.bfloat16, torch.float16):
        with graph.inserting_before(node):
            args[0] = call(
                graph, aten._to_copy.default, (args[0],), {"dtype": torch.float32}, like=node
            )
    node.args, node.kwargs = tuple(args), {}
    node.meta["val"] = fake_eval(node)
    keep = call(graph, aten.ne.Scalar, (target, ignore_index), like=node)
    with graph.inserting_after(keep):
        count = call(graph, aten.sum.default, (keep,), like=node, name="num_tokens")
    return node, count


def _plain_mean(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, fx.Node]:
    x = node.args[0]
    loss_sum = call(graph, aten.sum.default, (x,), {"dtype": val(node).dtype}, like=node)
    with graph.inserting_after(loss_sum):
        count = call(
            graph, aten.scalar_tensor.default, (float(val(x).numel()),),
            {"dtype": torch.float32, "device": val(x).device}, like=node, name="num_tokens",
        )
    return loss_sum, count


def _is_ratio_of_sums(node: fx.Node) -> bool:
    num, den = node.args
    return (
        isinstance(num, fx.Node)
        and isinstance(den, fx.Node)
        and _is_full_sum(num)
        and _is_full_sum(_unclamped(den))
    )


def _unclamped(node: fx.Node) -> fx.Node:
    """``sum(w)`` under ``.clamp(min=1)`` / ``.clamp_min(1)``: the clamp only guards zero."""
    while node.target in (aten.clamp.default, aten.clamp_min.default):
        node = node.args[0]
    return node


def _is_full_sum(node: fx.Node) -> bool:
    if node.target == aten.sum.default:
        return True
    if node.target == aten.sum.dim_IntList:
        dims, x = arg(node, 1, "dim"), node.args[0]
        return dims in (None, []) or len(set(d % val(x).dim() for d in dims)) == val(x).dim()
    return False


def _is_full_mean_dim(node: fx.Node) -> bool:
    if node.target != aten.mean.dim:
        return False
    dims, x = arg(node, 1, "dim"), node.args[0]
    return dims in (None, []) or len(set(d % val(x).dim() for d in dims)) == val(x).dim()


def _depends_on_parameters(node: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" and _requires_grad(n):
            return True
        todo.extend(n.all_input_nodes)
    return False


def _requires_grad(node: fx.Node) -> bool:
    return bool(getattr(attr(node.graph.owning_module, node.target), "requires_grad", False))


def _is_scalar(node) -> bool:
    return isinstance(node, fx.Node) and val(node) is not None and val(node).dim() == 0


def _shape(node) -> list[int] | None:
    v = val(node) if isinstance(node, fx.Node) else None
    return list(v.shape) if v is not None else None


def _unrecognised(node: fx.Node) -> str:
    schema = op_schema(node.target)
    op = schema.name if schema is not None else str(node.target)
    if node.target is operator.getitem and is_hop(node.args[0]):
        region = node.args[0]
        return (
            f"cannot recognise the loss: it is computed inside a {region.target.name()} region "
            f"(node {region.name!r}, module {region.meta.get('fxmeg', {}).get('module', '')!r}: "
            "an autocast or no-grad block of forward), which fxmeg does not look into. Compute "
            "the loss outside the block, or pass "
            "loss_fn=lambda model, *batch: (loss_sum, num_tokens)."
        )
    return (
        f"cannot recognise the loss: it is computed by {op} (node {node.name!r}, module "
        f"{node.meta.get('fxmeg', {}).get('module', '')!r}), which is not a mean fxmeg can "
        "turn into (loss_sum, num_tokens). Recognised: cross_entropy / nll_loss with "
        "reduction='mean', sum(x) / sum(mask), x.mean(). Otherwise pass "
        "loss_fn=lambda model, *batch: (loss_sum, num_tokens)."
    )
