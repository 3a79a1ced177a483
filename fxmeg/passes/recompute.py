"""Activation recompute (Megatron's --recompute-granularity) as a pass on chunk graphs.

A *region* of a chunk graph is moved into a parameter-free sub-graph that runs under
``torch.utils.checkpoint`` (non-reentrant): forward keeps only the region's inputs for
backward, and backward runs the region again from them (with the same random state, so
dropout masks repeat). Parameters enter a region as inputs, so the chunk's parameters,
state dict and gradient buckets do not change; the body of a higher-order op in a region
(an autocast or no-grad region of the model) moves into the region's graph with it.

  full       each transformer block is one region; ``num_layers`` limits it to the first
             that many blocks of every chunk (Megatron's "block" method). A block then
             keeps only its input per micro-batch.
  selective  each attention core is one region: a fused ``scaled_dot_product_attention``
             op, or the eager chain scores = q @ k^T -> scale / mask -> softmax ->
             dropout -> @ v, whose s x s intermediates dominate activation memory.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from fxmeg.config_sections import GRANULARITIES, RecomputeConfig
from fxmeg.errors import PassError
from fxmeg.ir import ops
from fxmeg.ir.program import ChunkInfo
from fxmeg.ir.recomputation import Recomputation
from fxmeg.ir.tags import set_tags, tags
from fxmeg.passes.graph_utils import attr, is_subgraph
from fxmeg.passes.partition import find_blocks

aten = torch.ops.aten
_MARKERS = {
    ops.recv,
    ops.send,
    ops.deallocate,
    ops.wait_param_gather,
    ops.zero_gather,
    ops.zero_release,
}
_SCORES = {aten.matmul.default, aten.bmm.default, aten.mm.default}
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}
_BETWEEN_SCORES = {  # elementwise steps between q @ k^T and the softmax (scale, mask)
    aten.div.Tensor, aten.mul.Tensor, aten.add.Tensor, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.where.self, aten.to.dtype, aten._to_copy.default,
}


class Recompute(nn.Module):
    """Runs ``region`` (a graph without parameters) under activation checkpointing;
    while backward runs it again, ``self.recomputation.recomputing()`` is True."""

    def __init__(self, region: fx.GraphModule) -> None:
        super().__init__()
        self.region = region
        self.recomputation = Recomputation()
        """Whose recomputation this is: the rank's (``collectives.bind`` sets
        ``RankContext.recomputation``); unbound, the region's own."""

    def forward(self, *args):
        if not torch.is_grad_enabled():  # evaluation: nothing is kept anyway
            return self.region(*args)
        if torch.compiler.is_compiling():  # dynamo takes no plain context_fn (nothing counts there)
            return checkpoint(self.region, *args, use_reentrant=False)
        return checkpoint(
            self._run, *args, use_reentrant=False, context_fn=self.recomputation.contexts
        )

    def _run(self, *args):
        self.recomputation.prepare(args)  # zero=3: its parameters whole again when backward runs it
        return self.region(*args)


def recompute(
    gm: fx.GraphModule, *, recomputation: RecomputeConfig, chunk: ChunkInfo
) -> fx.GraphModule:
    """Move each region (see the module docstring) of the chunk graph ``gm`` into a
    ``Recompute`` submodule called in its place (``recomputation.recompute``; with "full",
    ``recomputation.recompute_num_layers`` counts the blocks of this chunk).

    Scope: one chunk graph (the driver runs it on each); ``chunk`` is not needed.
    Requires: a chunk graph of the pipeline pass.
    Ensures: the chunk computes the same outputs and gradients as before; every node of
    a region lives in its sub-graph; no parameter or buffer changes its name."""
    granularity = recomputation.recompute
    assert granularity in GRANULARITIES, granularity  # RecomputeConfig checks it
    if granularity == "none":
        return gm
    regions = (
        _blocks(gm, recomputation.recompute_num_layers)
        if granularity == "full"
        else _attention_cores(gm)
    )
    for i, nodes in enumerate(regions):
        _extract(gm, nodes, f"recompute_{i}")
    gm.graph.lint()
    gm.recompile()
    return gm


def _blocks(gm: fx.GraphModule, num_layers: int | None) -> list[list[fx.Node]]:
    block_of = find_blocks(gm)
    order: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in block_of and node.target not in _MARKERS:
            order.setdefault(block_of[node], []).append(node)
    regions = list(order.values())
    return regions if num_layers is None else regions[:num_layers]


def _attention_cores(gm: fx.GraphModule) -> list[list[fx.Node]]:
    regions = []
    for node in gm.graph.nodes:
        if node.target in (
            aten.scaled_dot_product_attention.default,
            torch.ops.fxmeg.cp_attention.default,
        ):
            regions.append([node])
        elif node.target == torch.ops.fxmeg.cp_ring_attention.default:
            regions.append([node, *node.users])  # with the getitem of its output
        elif node.target in _SOFTMAX:
            region = _eager_core(node)
            if region:
                regions.append(region)
    return regions


def _eager_core(softmax: fx.Node) -> list[fx.Node] | None:
    """q @ k^T ... softmax ... @ v around ``softmax``, or None if it is not one."""
    start = softmax.args[0]
    while isinstance(start, fx.Node) and start.target in _BETWEEN_SCORES:
        start = start.args[0]
    if not (isinstance(start, fx.Node) and start.target in _SCORES):
        return None
    end, frontier = None, [softmax]
    while frontier and end is None:  # first matmul downstream (through dropout / views)
        nxt = []
        for n in frontier:
            for user in n.users:
                if user.target in _SCORES:
                    end = user
                    break
                if (
                    user.op == "call_function"
                    and user.target not in _MARKERS
                    and user.target not in _SOFTMAX
                ):
                    nxt.append(user)
            if end is not None:
                break
        frontier = nxt
    if end is None:
        return None
    after = _descendants(start)
    before = _ancestors(end)
    return [n for n in start.graph.nodes if n is start or n is end or (n in after and n in before)]


def _descendants(node: fx.Node) -> set[fx.Node]:
    return _reach(node, lambda n: n.users)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    return _reach(node, lambda n: n.all_input_nodes)


def _reach(node: fx.Node, step) -> set[fx.Node]:
    """Every node reachable from ``node`` (excluded) along ``step``."""
    seen, stack = set(), [node]
    while stack:
        for other in step(stack.pop()):
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return seen


def _extract(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> None:
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for i in n.all_input_nodes:
            if i not in inside and i not in inputs:
                inputs.append(i)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    last = nodes[-1]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for out in outputs:
        early = [u for u in out.users if u not in inside and position[u] < position[last]]
        if early:
            raise PassError(
                f"recompute: {early[0].name!r} reads {out.name!r} in the middle of region "
                f"{nodes[0].name}..{last.name} (module "
                f"{nodes[0].meta.get('fxmeg', {}).get('module')!r}); this block's nodes are not "
                "contiguous, so it cannot be recomputed as one region"
            )
    bodies = [i for i in inputs if is_subgraph(i)]  # a higher-order op's body: not a value
    inputs = [i for i in inputs if i not in bodies]
    sub = fx.Graph()
    env = {i: sub.placeholder(i.name) for i in inputs}
    for i in inputs:
        env[i].meta = dict(i.meta)
    for b in bodies:
        env[b] = sub.get_attr(b.target)
        env[b].meta = dict(b.meta)
    for n in nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    region = fx.GraphModule({b.target: attr(gm, b.target) for b in bodies}, sub)
    gm.add_submodule(name, Recompute(region))
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    set_tags(call, tags(nodes[0]))
    anchor = call
    for k, out in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            part = gm.graph.call_function(operator.getitem, (call, k))
        part.meta = dict(out.meta)
        out.replace_all_uses_with(part, delete_user_cb=lambda u: u not in inside)
        anchor = part
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    for b in bodies:
        if not b.users:
            gm.graph.erase_node(b)
