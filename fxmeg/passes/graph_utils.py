"""Small helpers shared by the passes: argument lookup, fake-tensor metadata, node creation."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of an ATen call, given positionally at ``index`` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def full_args(node: fx.Node) -> list[Any]:
    """Every schema argument of an ATen call, positionally, defaults filled in."""
    schema = node.target._schema
    out = []
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out.append(node.args[i])
        elif a.name in node.kwargs:
            out.append(node.kwargs[a.name])
        else:
            out.append(a.default_value)
    return out


def attr(gm: fx.GraphModule, target: str) -> Any:
    """The object a get_attr ``target`` (a dotted FQN) names in ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def val(node: fx.Node) -> torch.Tensor | None:
    """The fake tensor export recorded for ``node`` (shape, dtype, device), if any."""
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def call(
    graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, *, like: fx.Node, name: str | None = None
):
    """Insert ``target(*args)`` with ``meta['val']`` computed on fake tensors.

    The new node inherits the fxmeg metadata (owning module) of ``like``.
    """
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
    node.meta["fxmeg"] = dict(like.meta.get("fxmeg", {}))
    node.meta["val"] = fake_eval(node)
    return node


def fake_eval(node: fx.Node) -> Any:
    """Evaluate ``node`` on its inputs' fake values (no real compute)."""
    vals = [n.meta["val"] for n in node.all_input_nodes if "val" in n.meta]
    if not vals:  # a constant: borrow the mode of any value in the graph
        vals = [n.meta["val"] for n in node.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    mode = detect_fake_mode(vals)
    assert mode is not None, f"node {node.name} has no fake inputs"
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with mode:
        return node.target(*args, **kwargs)


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform) -> fx.Node:
    """``graph.node_copy`` with its own ``meta["fxmeg"]`` dict: FX copies meta shallowly,
    and a tag added to one copy must not appear on the original or on other copies."""
    new = graph.node_copy(node, arg_transform)
    new.meta["fxmeg"] = dict(node.meta.get("fxmeg", {}))
    return new


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop dead pure nodes, check the graph and regenerate code: every pass ends here."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def requires_grad_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value requires grad in training: float values that depend on a
    trainable parameter through differentiable ops."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if getattr(attr(gm, n.target), "requires_grad", False):
                out.add(n)
        elif n.op == "call_function" and n.target != torch.ops.aten.detach.default:
            v = val(n)
            floating = not isinstance(v, torch.Tensor) or v.is_floating_point() or v.is_complex()
            if floating and any(i in out for i in n.all_input_nodes):
                out.add(n)
    return out
