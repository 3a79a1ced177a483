"""Param-gather pass: wait for each bucket's parameter all-gather just before forward first
reads one of its parameters (distributed optimizer with overlap_param_gather).

Runs only with ``config.overlap_param_gather``; otherwise the graph is unchanged.

Scope: one chunk graph (the driver runs it on each); the bucket tags name their home
chunk, so it needs no other chunk.
Requires: the bucket pass (``meta["fxmeg"]["bucket"]`` on trainable parameters' get_attr).
Ensures: in the chunk graph, for every bucket whose parameters the chunk reads, one
``fxmeg.ops.wait_param_gather(param, bucket=(home chunk, index))`` node comes before the first
node that uses any parameter of that bucket; every use of those parameters follows it.
Forward reads the last buckets first (buckets are laid out in backward order), so the
waits come in descending bucket order and the gathers of later-read buckets overlap the
compute of earlier layers.
"""

from __future__ import annotations

from torch import fx

from fxmeg import ops
from fxmeg.config import EngineConfig
from fxmeg.passes.graph_utils import finish
from fxmeg.program import ChunkInfo


def param_gather(gm: fx.GraphModule, *, config: EngineConfig, chunk: ChunkInfo) -> fx.GraphModule:
    """The waits of the chunk graph ``gm`` (see the module docstring); ``chunk`` is not needed."""
    if not config.overlap_param_gather:
        return gm
    first_use: dict[tuple, tuple[fx.Node, fx.Node]] = {}  # bucket -> (user, param)
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            tag = arg.meta.get("fxmeg", {}).get("bucket") if arg.op == "get_attr" else None
            if tag is not None:
                first_use.setdefault(tag.gather_key, (node, arg))
    for (home, index), (user, param) in first_use.items():
        with gm.graph.inserting_before(user):
            wait = gm.graph.create_node(
                "call_function", ops.wait_param_gather, (param,), {"bucket": (home, index)},
                name=f"wait_param_gather_{home}_{index}",
            )
            wait.meta["fxmeg"] = {"module": ""}
    return finish(gm)
