"""Pipeline pass: one graph per chunk, with explicit receive / send / deallocate nodes.

Requires: outputs ``(loss_sum, num_tokens)`` (loss pass) and every call_function node
tagged with ``meta["fxmeg"]["chunk"]`` (partition pass), chunks only reading values
of earlier chunks.

Ensures: the result is a parent graph whose submodules ``chunk_0 .. chunk_{K-1}`` are the
chunk graphs and whose forward chains them, computing exactly what the input computed.
For chunk k:
  * placeholders are the micro-batch inputs it reads (in input order), then one per
    tensor received from chunk k-1, named like the value in the captured graph;
  * every received tensor passes through ``fxmeg.ir.ops.recv`` and every tensor needed by a
    later chunk leaves through ``fxmeg.ir.ops.send`` (to chunk k+1: a value that skips
    chunks is relayed by each chunk in between); nodes carry peer chunk, shape, dtype,
    and ``grad``: whether a gradient flows back;
  * a sent tensor this chunk produced, that requires grad and that nothing else in the
    chunk reads, is marked with ``fxmeg.ir.ops.deallocate`` (the executor frees it once sent);
  * it returns its send nodes, the last chunk then ``(loss_sum, num_tokens)``;
  * a parameter or buffer read by several chunks is a get_attr in each of them (the same
    tensor object): tied weights stay tied when chunks share a rank, and are recorded as
    tied groups for gradient all-reduce when they do not;
  * a higher-order op (an autocast or no-grad region) runs in one chunk, which holds its
    body under the same ``_fxmeg_hop`` name; values a no-grad region returns cross
    boundaries with ``grad`` False;
  * ``gm.meta["fxmeg"]["spec"]`` holds its ``fxmeg.ir.program.ChunkSpec``;
  * the parent keeps the input graph's ``gm.meta["fxmeg"]`` (capture, facts, cp, partition).
``fxmeg.ir.program.chunks`` lists the chunk graphs; the driver hands each to the per-chunk
passes after this one (fxmeg/frontend/pass_driver.py).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxmeg.config import ParallelConfig
from fxmeg.ir import ops
from fxmeg.ir.program import Boundary, ChunkSpec, chunk_name, chunk_spec
from fxmeg.ir.tags import set_tags, tag, tags
from fxmeg.passes.graph_utils import attr, copy_node, finish, requires_grad_nodes, val

aten = torch.ops.aten


def pipeline(gm: fx.GraphModule, parallel: ParallelConfig) -> fx.GraphModule:
    """Split the chunk-tagged graph ``gm`` into pp * vpp chunk graphs under one parent."""
    num_chunks = parallel.num_chunks
    nodes = list(gm.graph.nodes)
    chunk_of = {n: tag(n, "chunk") for n in nodes if n.op == "call_function"}
    output = gm.graph.output_node()
    last_use = {
        n: max((_user_chunk(u, chunk_of, num_chunks) for u in n.users), default=-1)
        for n in chunk_of
    }
    grads = requires_grad_nodes(gm)
    # cuts[k]: values produced in chunks <= k and read after k, in graph order
    cuts = [
        [n for n in chunk_of if chunk_of[n] <= k < last_use[n]] for k in range(num_chunks - 1)
    ]
    boundaries = [
        tuple(Boundary(n.name, tuple(val(n).shape), val(n).dtype, n in grads, k) for n in cut)
        for k, cut in enumerate(cuts)
    ]
    inputs = [n for n in nodes if n.op == "placeholder"]
    children = {}
    for k in range(num_chunks):
        recv = boundaries[k - 1] if k else ()
        send = boundaries[k] if k < num_chunks - 1 else ()
        recv_nodes = cuts[k - 1] if k else []
        send_nodes = cuts[k] if k < num_chunks - 1 else []
        body = [n for n in nodes if chunk_of.get(n) == k]
        children[chunk_name(k)] = _chunk_graph(
            gm, k, body, inputs, recv, recv_nodes, send, send_nodes,
            loss=output.args[0] if k == num_chunks - 1 else None,
        )
    parent = _parent(children, inputs, boundaries)
    set_tags(parent, tags(gm))
    return finish(parent)


def _user_chunk(user: fx.Node, chunk_of: dict, num_chunks: int) -> int:
    return num_chunks - 1 if user.op == "output" else chunk_of[user]


def _chunk_graph(gm, k, body, inputs, recv, recv_nodes, send, send_nodes, loss):
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, torch.Tensor] = {}
    body_set = set(body)
    used_inputs = [
        (i, p) for i, p in enumerate(inputs) if any(u in body_set for u in p.users)
    ]
    for _, p in used_inputs:
        env[p] = copy_node(graph, p, lambda n: n)
    received = [graph.placeholder(n.name) for n in recv_nodes]
    for b, n, ph in zip(recv, recv_nodes, received):
        ph.meta = {"val": val(n), "fxmeg": {"module": ""}}
        env[n] = _marker(
            graph,
            ops.recv,
            (ph,),
            dict(src_chunk=k - 1, shape=list(b.shape), dtype=b.dtype, grad=b.grad),
            f"recv_{n.name}",
            ph.meta,
        )

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:  # a parameter, buffer or constant: this chunk reads it itself
            assert n.op == "get_attr", f"chunk {k} reads {n.name} from a later chunk"
            attrs[n.target] = attr(gm, n.target)
            env[n] = graph.get_attr(n.target)
            env[n].meta = dict(n.meta)
            set_tags(env[n], tags(n))
        return env[n]

    for n in body:
        env[n] = copy_node(graph, n, lookup)
    outputs, deallocate = [], []
    for b, n in zip(send, send_nodes):
        info = dict(dst_chunk=k + 1, shape=list(b.shape), dtype=b.dtype, grad=b.grad)
        s = _marker(graph, ops.send, (env[n],), info, f"send_{n.name}", env[n].meta)
        free = n in body_set and b.grad and all(u is s for u in env[n].users)
        if free:
            _marker(graph, ops.deallocate, (s,), {}, f"deallocate_{n.name}", {})
        outputs.append(s)
        deallocate.append(free)
    if loss is not None:
        outputs.extend(env[n] for n in loss)
    graph.output(tuple(outputs))
    chunk = fx.GraphModule(attrs, graph)
    set_tags(chunk, {"spec": ChunkSpec(
        index=k,
        data_inputs=tuple(i for i, _ in used_inputs),
        recv=recv,
        send=send,
        deallocate=tuple(deallocate),
        is_last=loss is not None,
    )})
    return finish(chunk)


def _marker(graph, fn, args, kwargs, name, meta) -> fx.Node:
    node = graph.create_node("call_function", fn, args, kwargs, name=name)
    node.meta = {**meta, "fxmeg": {"module": ""}}
    return node


def _parent(children: dict, inputs: list[fx.Node], boundaries) -> fx.GraphModule:
    """A graph that runs the chunks one after the other in one process."""
    graph = fx.Graph()
    env = {p: graph.node_copy(p) for p in inputs}
    carried: list[fx.Node] = []
    for k, (name, chunk) in enumerate(children.items()):
        spec = chunk_spec(chunk)
        args = [env[inputs[i]] for i in spec.data_inputs] + carried
        out = graph.call_module(name, tuple(args))
        results = [
            graph.call_function(operator.getitem, (out, i))
            for i in range(len(spec.send) + 2 * spec.is_last)
        ]
        carried = results[: len(spec.send)]
    graph.output(tuple(results[-2:]))
    return fx.GraphModule(children, graph)
