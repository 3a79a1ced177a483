"""Small helpers shared by the passes: argument lookup, fake-tensor metadata, node creation,
and the sub-graphs of higher-order ops."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from fxmeg.ir.tags import set_tags, tags
from fxmeg.torch_private import HigherOrderOperator, detect_fake_mode, op_schema

# Higher-order ops that call their body on the arguments that follow it (export's
# autocast and set-grad-enabled regions, dynamo's wrap, activation-checkpoint tags).
_WRAPS = {"wrap", "wrap_with_autocast", "wrap_with_set_grad_enabled", "tag_activation_checkpoint"}


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of an ATen call, given positionally at ``index`` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def source(node: fx.Node, through: set) -> fx.Node:
    """Follow ``node``'s first argument back through ops of ``through`` (casts, views):
    the node they start from."""
    while node.op == "call_function" and node.target in through:
        node = node.args[0]
    return node


def full_args(node: fx.Node) -> list[Any]:
    """Every schema argument of an ATen call, positionally, defaults filled in."""
    schema = op_schema(node.target)
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


def carries_grad(node: fx.Node) -> bool:
    """Whether a gradient can flow back through ``node``: it outputs a floating-point
    tensor (or several, or is no tensor op: an output, a region's call). Integer and
    boolean results (top-k indices, a comparison) pass none to their inputs."""
    v = node.meta.get("val")
    values = v if isinstance(v, (list, tuple)) else [v]
    tensors = [t for t in values if isinstance(t, torch.Tensor)]
    return not tensors or any(t.is_floating_point() or t.is_complex() for t in tensors)


def bound(x) -> float:
    """A traced size (or a product of them) as a number: a data-dependent size (an unbacked
    symbol, e.g. the tokens JetMoE's router sends to one expert, read with ``.tolist()``)
    counts at the upper bound of its value range, where torch knows one: a cost estimate
    that never undercounts. Plain numbers pass through."""
    if not isinstance(x, (torch.SymInt, torch.SymFloat)):
        return float(x)
    node = x.node
    if node.hint is not None:
        return float(node.hint)
    env = node.shape_env
    upper = env.bound_sympy(node.expr).upper
    if upper.is_finite:
        return float(upper)
    raise ValueError(f"the size {node.expr} depends on the data and has no upper bound")


def call(
    graph: fx.Graph,
    target,
    args: tuple,
    kwargs: dict | None = None,
    *,
    like: fx.Node,
    name: str | None = None,
):
    """Insert ``target(*args)`` with ``meta['val']`` computed on fake tensors.

    The new node inherits the fxmeg metadata (owning module) of ``like``.
    """
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
    set_tags(node, tags(like))
    node.meta["val"] = fake_eval(node)
    return node


def fake_eval(node: fx.Node) -> Any:
    """Evaluate ``node`` on its inputs' fake values (no real compute); a higher-order op
    runs its body on them."""
    vals = [n.meta["val"] for n in node.all_input_nodes if "val" in n.meta]
    if not vals:  # a constant: borrow the mode of any value in the graph
        vals = [
            n.meta["val"] for n in node.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
        ]
    mode = detect_fake_mode(vals)
    assert mode is not None, f"node {node.name} has no fake inputs"
    owner = node.graph.owning_module
    args, kwargs = fx.node.map_arg(
        (node.args, node.kwargs),
        lambda n: attr(owner, n.target) if is_subgraph(n) else n.meta["val"],
    )
    with mode:
        return node.target(*args, **kwargs)


def expand_add_matmul(node: fx.Node) -> list[fx.Node]:
    """Replace ``baddbmm(input, a, b, beta, alpha)`` in its graph by ``beta * input + alpha *
    (a @ b)``, so that a sharding pass places each part by its own rule (GPT-BigCode's and
    Bloom's attention scores: ALiBi's bias plus q @ k^T); with ``beta == 0`` the product
    alone, as torch ignores the input then (GPT-BigCode passes ``torch.empty``: its NaN
    must not leak). Returns the new nodes in order, the last computing the result."""
    g, aten = node.graph, torch.ops.aten
    x, a, b = node.args[:3]
    beta, alpha = full_args(node)[3:5]
    new: list[fx.Node] = []

    def add(target, *args) -> fx.Node:
        with g.inserting_before(node):
            new.append(call(g, target, args, like=node))
        return new[-1]

    out = add(aten.bmm.default, a, b)
    if alpha != 1:
        out = add(aten.mul.Tensor, out, alpha)
    if beta != 0:
        out = add(aten.add.Tensor, add(aten.mul.Tensor, x, beta) if beta != 1 else x, out)
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return new


def divide_shape_arg(node: fx.Node, dim: int, k: int) -> None:
    """Make the reshape / view (its shape argument) or ``unflatten`` (its sizes) ``node``
    produce 1/k of output dim ``dim``; an inferred size (-1) stays inferred. What a pass
    does after splitting that dim over k ranks (tensor or context parallelism)."""
    if node.target == torch.ops.aten.unflatten.int:
        first, sizes = node.args[1] % len(val(node.args[0]).shape), list(node.args[2])
        if sizes[dim - first] != -1:
            sizes[dim - first] //= k
        node.args = (node.args[0], node.args[1], sizes)
    else:
        shape = list(node.args[1])
        if shape[dim] != -1:
            shape[dim] //= k
        node.args = (node.args[0], shape)


def users_reached(start: fx.Node, through: Callable[[fx.Node], bool]) -> Iterator[fx.Node]:
    """Every call_function node reached from ``start`` along its users, each once; the
    walk goes on past a reached node only where ``through(node)`` holds."""
    todo, seen = [start], {start}
    while todo:
        for user in todo.pop().users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            yield user
            if through(user):
                todo.append(user)


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform) -> fx.Node:
    """``graph.node_copy`` with its own ``meta["fxmeg"]`` dict: FX copies meta shallowly,
    and a tag added to one copy must not appear on the original or on other copies."""
    new = graph.node_copy(node, arg_transform)
    set_tags(new, tags(node))
    return new


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop dead pure nodes, check the graph and regenerate code: every pass ends here."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def requires_grad_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value requires grad in training: float values that depend on a
    trainable parameter through differentiable ops. A region under
    ``torch.no_grad()`` (``wrap_with_set_grad_enabled(False, ...)``) returns values that
    do not; other regions are followed into their bodies, output by output."""
    return _grad_flow(gm, set())


def _grad_flow(gm: fx.GraphModule, seeds: set[fx.Node]) -> set[fx.Node]:
    out: set[fx.Node] = set(seeds)
    per_output: dict[fx.Node, list[bool]] = {}  # higher-order op -> does output i need grad
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if getattr(attr(gm, n.target), "requires_grad", False):
                out.add(n)
        elif n.op != "call_function" or n.target == torch.ops.aten.detach.default:
            continue
        elif is_hop(n):
            per_output[n] = _hop_grads(n, out)
            if any(per_output[n]):
                out.add(n)
        else:
            v = val(n)
            floating = not isinstance(v, torch.Tensor) or v.is_floating_point() or v.is_complex()
            if n.target is operator.getitem and n.args[0] in per_output:
                flags = per_output[n.args[0]]
                needs = flags[n.args[1]] if n.args[1] < len(flags) else any(flags)
            else:
                needs = any(i in out for i in n.all_input_nodes)
            if floating and needs:
                out.add(n)
    return out


def _hop_grads(node: fx.Node, out: set[fx.Node]) -> list[bool]:
    """Per output of higher-order op ``node``: whether it requires grad."""
    call_ = body_call(node)
    outputs = node.meta.get("val")
    count = len(outputs) if isinstance(outputs, (tuple, list)) else 1
    if call_ is None:  # an op fxmeg does not look into: any grad input taints every output
        return [any(i in out for i in node.all_input_nodes)] * count
    body, operands = call_
    if without_grad(node):
        return [False] * count
    placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
    seeds = {p for p, a in zip(placeholders, operands) if isinstance(a, fx.Node) and a in out}
    inner = _grad_flow(body, seeds)
    results = body.graph.output_node().args[0]
    results = results if isinstance(results, (tuple, list)) else (results,)
    return [isinstance(r, fx.Node) and r in inner for r in results]


def inline(node: fx.Node) -> dict[int, fx.Node] | None:
    """Replace wrap-style higher-order op ``node`` by copies of its body's nodes, dropping
    the region's context (autocast, grad mode); its ``getitem`` users are replaced by the
    copied results. Returns {output index: copied node}, or None (nothing changed) when
    ``node`` is not a wrap-style op or its body calls nested bodies."""
    found = body_call(node)
    if found is None or any(n.op == "get_attr" for n in found[0].graph.nodes):
        return None
    body, operands = found
    graph = node.graph
    placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
    env: dict[fx.Node, Any] = dict(zip(placeholders, operands))
    with graph.inserting_before(node):
        for n in body.graph.nodes:
            if n.op not in ("placeholder", "output"):
                env[n] = copy_node(graph, n, lambda a: env[a])
    results = body.graph.output_node().args[0]
    results = results if isinstance(results, (tuple, list)) else (results,)
    copied = {i: env[r] for i, r in enumerate(results) if isinstance(r, fx.Node)}
    for user in list(node.users):
        assert user.target is operator.getitem, f"{user.name} reads region {node.name} whole"
        user.replace_all_uses_with(copied[user.args[1]])
        graph.erase_node(user)
    getters = [a for a in node.all_input_nodes if is_subgraph(a)]
    graph.erase_node(node)
    for getter in getters:  # the body, unless another region calls it too
        if not getter.users:
            graph.erase_node(getter)
            if not any(n.op == "get_attr" and n.target == getter.target for n in graph.nodes):
                graph.owning_module.delete_submodule(getter.target)
    return copied


def is_hop(node: fx.Node) -> bool:
    """A call of a higher-order op (autocast / no-grad region, wrap, cond ...): it calls
    sub-graphs that are get_attr operands naming GraphModules."""
    return node.op == "call_function" and isinstance(node.target, HigherOrderOperator)


def without_grad(node: fx.Node) -> bool:
    """A ``torch.no_grad()`` region (``wrap_with_set_grad_enabled(False, ...)``): no
    gradient flows back into its operands through it."""
    return is_hop(node) and node.target.name() == "wrap_with_set_grad_enabled" and not node.args[0]


def is_subgraph(node: fx.Node) -> bool:
    """A get_attr of a GraphModule: the body of a higher-order op, not a tensor."""
    if node.op != "get_attr":
        return False
    return isinstance(attr(node.graph.owning_module, node.target), fx.GraphModule)


def subgraphs(node: fx.Node) -> list[fx.GraphModule]:
    """The bodies higher-order op ``node`` calls (none for other nodes)."""
    if not is_hop(node):
        return []
    owner = node.graph.owning_module
    return [attr(owner, a.target) for a in node.all_input_nodes if is_subgraph(a)]


def body_call(node: fx.Node) -> tuple[fx.GraphModule, tuple] | None:
    """(body, operands) of a wrap-style higher-order op, which calls its body on the
    arguments after it (``wrap_with_autocast(device, dtype, enabled, cache, body, *operands)``,
    ``wrap_with_set_grad_enabled(enabled, body, *operands)``, ``wrap(body, *operands)``);
    None for other nodes and other higher-order ops (cond, map, ...)."""
    if not is_hop(node) or node.target.name() not in _WRAPS:
        return None
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node) and is_subgraph(a):
            return attr(node.graph.owning_module, a.target), tuple(node.args[i + 1 :])
    return None
