"""Param-gather pass: wait for each bucket's parameter all-gather just before forward first
reads one of its parameters (distributed optimizer with overlap_param_gather).

Runs only with ``config.overlap_param_gather``; otherwise the graph is unchanged.

Requires: the bucket pass (``meta["fxmeg"]["bucket"]`` on trainable parameters' get_attr).
Ensures: in every chunk graph, for every bucket whose parameters the chunk reads, one
``fxmeg.ops.wait_param_gather(param, bucket=(chunk, index))`` node comes before the first
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
from fxmeg.program import chunks


def param_gather(parent: fx.GraphModule, config: EngineConfig) -> fx.GraphModule:
    if not config.overlap_param_gather:
        return parent
    for gm in chunks(parent):
        first_use: dict[tuple, tuple[fx.Node, fx.Node]] = {}  # bucket -> (user, param)
        for node in gm.graph.nodes:
            for arg in node.all_input_nodes:
                tag = arg.meta.get("fxmeg", {}).get("bucket") if arg.op == "get_attr" else None
                if tag is not None:
                    key = (tag[0], tag[2])
                    first_use.setdefault(key, (node, arg))
        for (chunk, index), (user, param) in first_use.items():
            with gm.graph.inserting_before(user):
                wait = gm.graph.create_node(
                    "call_function", ops.wait_param_gather, (param,), {"bucket": (chunk, index)},
                    name=f"wait_param_gather_{chunk}_{index}",
                )
                wait.meta["fxmeg"] = {"module": ""}
        finish(gm)
    return parent
