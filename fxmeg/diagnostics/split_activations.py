"""What one micro-batch of a split chunk holds under a zero-bubble schedule.

The split_backward pass cuts a chunk's backward into I (input gradients) and W (weight
gradients); the executor keeps a micro-batch's forward-saved tensors from its F until its
I, then only what W reads (the I graph's ``carry``) until its W. The carry is not a subset
of the saved tensors: it holds gradients that I made and W reads (a linear map's output
gradient, the head's logits gradient), and under recompute the inputs of weight matmuls
that I computed again. Counting the forward's saved tensors until W (as 1F1B's plan
does) under-counts a zero-bubble rank by those.

Both are read from the split's graphs (``SplitSpec``), each tensor once: a view counts as
the tensor it views, and parameters and buffers (and their views, a transposed weight)
count nothing, the model holding them anyway.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx

from fxmeg.diagnostics.saved_activations import routed_experts_bytes, view_root
from fxmeg.ir import ops
from fxmeg.ir.program import split_spec
from fxmeg.passes.graph_utils import val

RECEIVED, SENT_GRADIENT = "<received>", "<sent gradient>"
"""``split_held``'s names for the chunk's own inputs (what it received, its data) and for
the gradients of what it sent (the I graph's tangents), which belong to no module."""


def split_held(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """Per module (the innermost that made the tensor, '' for top-level code, and
    ``RECEIVED`` / ``SENT_GRADIENT``), the bytes one micro-batch of split chunk ``gm``
    holds (from F until I, from I until W). Requires: ``gm`` split by the split_backward
    pass; its graphs' values are (fake) tensors."""
    spec = split_spec(gm)
    forward, inputs = gm.zb_forward.graph, gm.zb_input.graph
    places = [n for n in forward.nodes if n.op == "placeholder"]
    state = set(places[: len(spec.state)])
    saved = [view_root(n) if isinstance(n, fx.Node) else None
             for n in forward.output_node().args[0][spec.outputs:]]
    kept: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for node in {n for n in saved if n is not None and n not in state}:
        kept[_module(node)][0] += _bytes(node)
    from_input = [n for n in inputs.nodes if n.op == "placeholder"]
    outs = inputs.output_node().args[0]
    carried, tangents = set(), set()
    for node in outs[len(outs) - spec.carry:]:
        if not isinstance(node, fx.Node):
            continue
        node = view_root(node)
        if node.op == "placeholder" and from_input.index(node) >= spec.saved:
            tangents.add(node)
            continue
        if node.op == "placeholder":
            node = saved[from_input.index(node)]  # kept since F
            if node is None or node in state:
                continue
        carried.add(node)
    for node in carried:
        kept[_module(node)][1] += _bytes(node, after_input=True)
    kept[SENT_GRADIENT][1] += sum(_bytes(n) for n in tangents)
    return {m: (a, b) for m, (a, b) in kept.items() if a or b}


def split_nodes(gm: fx.GraphModule) -> dict[str, int]:
    """Per module (as ``split_held``; '' for the rest), the nodes of split chunk ``gm``'s
    three graphs: what a rank's host memory holds of them scales with it
    (``cluster.SPLIT_NODE_BYTES``)."""
    count: dict[str, int] = defaultdict(int)
    for graph in (gm.zb_forward.graph, gm.zb_input.graph, gm.zb_weight.graph):
        for node in graph.nodes:
            count["" if node.op in ("placeholder", "output") else _module(node)] += 1
    return dict(count)


def _module(node: fx.Node) -> str:
    if node.op == "placeholder":
        return RECEIVED
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _bytes(node: fx.Node, *, after_input: bool = False) -> int:
    """A tensor's bytes; a split routed-experts block's state (its forward's autograd graph,
    no tensor: ``moe_split``) holds what ``routed_experts`` saves besides its output: from F
    until I, and (``after_input``) from I until W, where in a recompute region it is
    nothing until I (the block's inputs, which the graph holds anyway) and its graph, run
    again, after."""
    made = node.args[0] if node.target is operator.getitem else None
    if isinstance(made, fx.Node) and made.target is ops.routed_experts_split:
        # its value is a placeholder tensor, not the state
        again = made.kwargs.get("again") and not after_input
        return 0 if again else routed_experts_bytes(made)
    v = val(node)
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def held_weights(chunks: list[int], graphs: list[fx.GraphModule],
                 saved: list[int]) -> tuple[dict[int, int], dict[int, int] | None]:
    """``Simulation.peak_held_by``'s (weights, carry) for ``chunks`` (their graphs, and the
    bytes each saves for backward): each split chunk's micro-batch holds its split's saved
    tensors from F until I and its carry from I until W; the others (no split: carry None)
    ``saved`` until B or W."""
    if not any(split_spec(gm) for gm in graphs):
        return dict(zip(chunks, saved)), None
    kept = [[sum(k) for k in zip(*split_held(gm).values())] or [0, 0] for gm in graphs]
    return ({c: k[0] for c, k in zip(chunks, kept)}, {c: k[1] for c, k in zip(chunks, kept)})
