"""Param-gather pass: where forward waits for, gathers and frees each bucket's parameters.

  * ``overlap_param_gather`` (zero=1, 2): the optimizer all-gathers the updated
    parameters after its step; forward waits for a bucket's gather just before it first
    reads one of its parameters (``ops.wait_param_gather``).
  * zero=3: parameters are kept as this rank's shard between uses. Before forward first
    reads a bucket, ``ops.zero_gather`` makes it whole (and starts gathering the next
    bucket forward reads, to overlap with this one's compute); after forward last reads
    it, through any view of it, ``ops.zero_release`` frees it (not with
    ``reshard_after_forward=False``: the chunk's backward frees it). Backward gathers again
    what it needs (runtime/zero.py: autograd's saved tensors, recompute regions).

Otherwise the graph is unchanged.

Scope: one chunk graph (the driver runs it on each); the bucket tags name their home
chunk, so it needs no other chunk.
Requires: the bucket pass (``meta["fxmeg"]["bucket"]`` on trainable parameters' get_attr).
Ensures: in the chunk graph, for every bucket whose parameters the chunk reads, one
wait (or zero=3: gather) node, keyed ``bucket=(home chunk, index)``, comes before the
first node that uses any parameter of that bucket; every use of those parameters follows
it. At zero=3 (with ``reshard_after_forward``) one release node per bucket comes after every node that reads one of its
parameters or a value that may alias one (a view: ``t``, ``view``, ``getitem`` ..., or a
region whose body returns a view of its input), and each gather names as ``prefetch``
the bucket gathered next (None for the last). Forward reads the last buckets first
(buckets are laid out in backward order), so the keys come in descending bucket order.
"""

from __future__ import annotations

import torch
from torch import fx

from fxmeg import ops
from fxmeg.config import EngineConfig
from fxmeg.passes.graph_utils import attr, body_call, finish
from fxmeg.program import ChunkInfo


def param_gather(gm: fx.GraphModule, *, config: EngineConfig, chunk: ChunkInfo) -> fx.GraphModule:
    """The markers of the chunk graph ``gm`` (see the module docstring); ``chunk`` is not needed."""
    if config.zero_stage == 3:
        return _gather_and_release(gm, release=config.reshard_after_forward)
    if not config.overlap_param_gather:
        return gm
    for (home, index), (user, param) in _first_uses(gm).items():
        _marker(gm, user, ops.wait_param_gather, param, {"bucket": (home, index)}, f"wait_param_gather_{home}_{index}")
    return finish(gm)


def _first_uses(gm: fx.GraphModule) -> dict[tuple[int, int], tuple[fx.Node, fx.Node]]:
    """Bucket key -> (its first reader, the parameter it reads), in graph order."""
    first_use: dict[tuple, tuple[fx.Node, fx.Node]] = {}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            tag = arg.meta.get("fxmeg", {}).get("bucket") if arg.op == "get_attr" else None
            if tag is not None:
                first_use.setdefault(tag.gather_key, (node, arg))
    return first_use


def _marker(gm: fx.GraphModule, where: fx.Node, target, param: fx.Node, kwargs: dict, name: str,
            *, after: bool = False) -> fx.Node:
    with (gm.graph.inserting_after(where) if after else gm.graph.inserting_before(where)):
        node = gm.graph.create_node("call_function", target, (param,), kwargs, name=name)
    node.meta["fxmeg"] = {"module": ""}
    return node


def _gather_and_release(gm: fx.GraphModule, *, release: bool) -> fx.GraphModule:
    first = _first_uses(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last: dict[tuple[int, int], fx.Node] = {}
    for node in gm.graph.nodes:
        tag = node.meta.get("fxmeg", {}).get("bucket") if node.op == "get_attr" else None
        if tag is not None:
            for reader in _readers(node, gm):
                if tag.gather_key not in last or order[reader] > order[last[tag.gather_key]]:
                    last[tag.gather_key] = reader
    keys = list(first)
    for i, key in enumerate(keys):
        user, param = first[key]
        prefetch = keys[i + 1] if i + 1 < len(keys) else None
        home, index = key
        _marker(gm, user, ops.zero_gather, param, {"bucket": key, "prefetch": prefetch}, f"zero_gather_{home}_{index}")
        if release:
            _marker(gm, last[key], ops.zero_release, param, {"bucket": key}, f"zero_release_{home}_{index}",
                    after=True)
    return finish(gm)


def _readers(param: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """Every node that reads ``param``'s memory: the users of it and of every value that
    may be a view of it."""
    return [user for alias in _aliases(param, gm) for user in alias.users]


def _aliases(start: fx.Node, gm: fx.GraphModule) -> set[fx.Node]:
    """``start`` and every node whose result may share its memory (views of views too)."""
    out, todo = {start}, [start]
    while todo:
        for user in todo.pop().users:
            if user not in out and user.op != "output" and _may_alias(user, gm):
                out.add(user)
                todo.append(user)
    return out


def _may_alias(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node``'s result may share memory with one of its inputs: an aten op whose
    schema says so, a region whose body returns such a value, and (unknown) anything else."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in node.target._schema.returns)
    body = _body(node, gm)
    if body is None:
        return True
    aliased = set().union(*(_aliases(p, body) for p in body.graph.nodes if p.op == "placeholder"))
    return any(n in aliased for n in body.graph.output_node().all_input_nodes)


def _body(node: fx.Node, gm: fx.GraphModule) -> fx.GraphModule | None:
    """The graph a recompute region (call_module) or a wrap-style region runs."""
    if node.op == "call_module":
        module = attr(gm, node.target)
        region = getattr(module, "region", module)
        return region if isinstance(region, fx.GraphModule) else None
    called = body_call(node)
    return called[0] if called is not None else None
