"""Param-gather pass: where forward waits for, gathers and frees each bucket's parameters.

Why each marker goes where it does (overlap_param_gather; zero=3's gathers and releases,
the tied embedding's bucket; zero >= 2's ``early_linear``): docs/architecture.md §8.4.

Otherwise the graph is unchanged.

Scope: one chunk graph (the driver runs it on each); the bucket tags name their home
chunk, so it needs no other chunk.
Requires: the bucket pass (``meta["fxmeg"]["bucket"]`` on trainable parameters' get_attr).
Ensures: every ``ops.early_linear`` node reads a trainable parameter as its weight, and a
parameter of another bucket is read between that parameter's first read and it. In the
chunk graph, for every bucket whose parameters the chunk reads, one
wait (or zero=3: gather) node, keyed ``bucket=(home chunk, index)`` (a bucket of the
experts' buffer: ``(home chunk, index, 'experts')``), comes before the
first node that uses any parameter of that bucket; every use of those parameters follows
it. At zero=3 (with ``reshard_after_forward``) one release node per bucket comes after every node
that reads one of its parameters or a value that may alias one (a view: ``t``, ``view``, ``getitem``
..., or a region whose body returns a view of its input), and each gather names as ``prefetch`` the
bucket gathered next (None for the last). Forward reads the last buckets first (buckets are laid out
in backward order), so each buffer's keys come in descending bucket order (the dense buffer's
and the experts' interleaved, block by block).
"""

from __future__ import annotations

import torch
from torch import fx

from fxmeg.config import EngineConfig
from fxmeg.ir import ops
from fxmeg.ir.program import ChunkInfo
from fxmeg.ir.tags import set_tags, tag, tags
from fxmeg.passes.graph_utils import attr, body_call, finish, val
from fxmeg.torch_private import OpOverload, op_schema

aten = torch.ops.aten


def param_gather(gm: fx.GraphModule, *, config: EngineConfig, chunk: ChunkInfo) -> fx.GraphModule:
    """The markers of the chunk graph ``gm`` (see the module docstring); ``chunk`` is not needed."""
    if (
        config.data_parallel.zero_stage >= 2
        and not config.compile
        and not config.parallel.splits_backward
    ):
        _early_reads(gm)
    if config.data_parallel.zero_stage == 3:
        return _gather_and_release(gm, release=config.data_parallel.reshard_after_forward)
    if not config.data_parallel.overlap_param_gather:
        return finish(gm)
    for key, (user, param) in _first_uses(gm).items():
        name = f"wait_param_gather_{_name(key)}"
        _marker(gm, user, ops.wait_param_gather, param, {"bucket": key}, name)
    return finish(gm)


def _early_reads(gm: fx.GraphModule) -> None:
    """Replace each qualifying later read of a parameter by ``ops.early_linear``."""
    first: dict[str, int] = {}
    seen: list[tuple[int, tuple[int, int]]] = []  # (position, bucket key) of every read so far
    for at, node in enumerate(list(gm.graph.nodes)):
        for param in dict.fromkeys(a for a in node.all_input_nodes if _bucket(a) is not None):
            key = _bucket(param).gather_key
            start = first.setdefault(param.target, at)
            if at > start and _bias_free_linear(node, param) and _other_since(seen, key, start):
                with gm.graph.inserting_before(node):
                    early = gm.graph.call_function(
                        ops.early_linear, (node.args[0], param), {"name": param.target}
                    )
                early.meta = dict(node.meta)
                set_tags(early, tags(node))
                node.replace_all_uses_with(early)
                gm.graph.erase_node(node)
            seen.append((at, key))


def _bias_free_linear(node: fx.Node, weight: fx.Node) -> bool:
    """``node`` is ``linear(x, weight)`` with no bias, ``x`` of two or more dimensions."""
    if node.op != "call_function" or node.target is not aten.linear.default or node.kwargs:
        return False
    x, w, *bias = node.args
    x_val = val(x) if isinstance(x, fx.Node) else None
    return (
        w is weight
        and x is not weight
        and bias in ([], [None])
        and x_val is not None
        and x_val.dim() >= 2
    )


def _other_since(seen: list[tuple[int, tuple[int, int]]], key: tuple[int, int], start: int) -> bool:
    """Whether a parameter of a bucket other than ``key`` was read after position ``start``."""
    for pos, other in reversed(seen):
        if pos <= start:
            return False
        if other != key:
            return True
    return False


def _bucket(node: fx.Node):
    return tag(node, "bucket") if node.op == "get_attr" else None


def _first_uses(gm: fx.GraphModule) -> dict[tuple[int, int], tuple[fx.Node, fx.Node]]:
    """Bucket key -> (its first reader, the parameter it reads), in graph order."""
    first_use: dict[tuple, tuple[fx.Node, fx.Node]] = {}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            slot = tag(arg, "bucket") if arg.op == "get_attr" else None
            if slot is not None:
                first_use.setdefault(slot.gather_key, (node, arg))
    return first_use


def _marker(gm: fx.GraphModule, where: fx.Node, target, param: fx.Node, kwargs: dict, name: str,
            *, after: bool = False) -> fx.Node:
    with (gm.graph.inserting_after(where) if after else gm.graph.inserting_before(where)):
        node = gm.graph.create_node("call_function", target, (param,), kwargs, name=name)
    set_tags(node, {"module": ""})
    return node


def _gather_and_release(gm: fx.GraphModule, *, release: bool) -> fx.GraphModule:
    first = _first_uses(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last: dict[tuple[int, int], fx.Node] = {}
    for node in gm.graph.nodes:
        slot = tag(node, "bucket") if node.op == "get_attr" else None
        if slot is not None:
            for reader in _readers(node, gm):
                if slot.gather_key not in last or order[reader] > order[last[slot.gather_key]]:
                    last[slot.gather_key] = reader
    keys = list(first)
    for i, key in enumerate(keys):
        user, param = first[key]
        prefetch = keys[i + 1] if i + 1 < len(keys) else None
        _marker(
            gm,
            user,
            ops.zero_gather,
            param,
            {"bucket": key, "prefetch": prefetch},
            f"zero_gather_{_name(key)}",
        )
        if release:
            _marker(
                gm,
                last[key],
                ops.zero_release,
                param,
                {"bucket": key},
                f"zero_release_{_name(key)}",
                after=True,
            )
    return finish(gm)


def _name(key: tuple) -> str:
    """A marker's name suffix for bucket ``key``: ``0_3``, ``0_1_experts``."""
    return "_".join(map(str, key))


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
    if node.op == "call_function" and isinstance(node.target, OpOverload):
        return any(r.alias_info is not None for r in op_schema(node.target).returns)
    if node.target is ops.early_linear:  # a product: new memory
        return False
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
