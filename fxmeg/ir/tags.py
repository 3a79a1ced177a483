"""The tags the passes write on nodes and graphs, and the only accessors of
``node.meta["fxmeg"]`` and ``gm.meta["fxmeg"]``: each key with the type of its value
(docs/architecture.md §2's table says who writes and who reads each). A key that is not
here, or a value of another type, is a bug of the pass writing it: refused at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import fx

if TYPE_CHECKING:
    from collections.abc import Mapping

_KEY = "fxmeg"

NODE_TAGS: dict[str, str] = {
    "module": "str: FQN of the innermost module that created the node ('' for the model's own)",
    "pass": "str: the pass that inserted the node (absent on captured nodes)",
    "loss": "str: 'sum' or 'count' on the two loss outputs",
    "tp": "Shard | Replicate: a parameter's tensor-parallel layout",
    "chunk": "int: the pipeline chunk of a call_function node",
    "ep": "ExpertShard: a routed-experts bank's split over ep",
    "bucket": "BucketSlot: a trainable parameter's gradient bucket",
}
"""Tags on nodes: key -> what its value is."""

GRAPH_TAGS: dict[str, str] = {
    "capture": "CaptureInfo: the captured graph's inputs, aliases and loss",
    "facts": "ModelFacts: FLOPs, value checks, position tables",
    "cp": "CPLayout: how the runtime cuts each input over cp (cp > 1)",
    "partition": "Partition: the pipeline cut and its placement",
    "tp_whole": "tuple: projections every tp rank holds whole, and why",
    "spec": "ChunkSpec: a chunk graph's inputs, outputs and boundaries",
    "buffers": "tuple[BufferLayout, ...]: a chunk's gradient buffers",
    "split": "SplitSpec: a chunk's zero-bubble forward / input / weight graphs",
}
"""Tags on graph modules: key -> what its value is."""


def _table(owner) -> dict[str, str]:
    return NODE_TAGS if isinstance(owner, fx.Node) else GRAPH_TAGS


def _known(owner, key: str) -> None:
    if key not in _table(owner):
        kind = "node" if isinstance(owner, fx.Node) else "graph"
        raise KeyError(
            f"{key!r} is no {kind} tag of fxmeg (fxmeg/ir/tags.py: {sorted(_table(owner))})"
        )


def tag(owner: fx.Node | fx.GraphModule, key: str, default=None):
    """The value of tag ``key`` on a node or a graph module, or ``default``."""
    _known(owner, key)
    return owner.meta.get(_KEY, {}).get(key, default)


def has_tag(owner: fx.Node | fx.GraphModule, key: str) -> bool:
    _known(owner, key)
    return key in owner.meta.get(_KEY, {})


def set_tag(owner: fx.Node | fx.GraphModule, key: str, value) -> None:
    """Write tag ``key``, the owner's other tags kept, in a dict of its own (FX copies a
    node's meta shallowly: nodes copied from one another may share the old one)."""
    _known(owner, key)
    owner.meta[_KEY] = {**owner.meta.get(_KEY, {}), key: value}


def tags(owner: fx.Node | fx.GraphModule) -> dict:
    """A copy of every tag of ``owner`` (to carry them onto a node or graph derived from it)."""
    return dict(owner.meta.get(_KEY, {}))


def set_tags(owner: fx.Node | fx.GraphModule, values: Mapping) -> None:
    """Replace every tag of ``owner`` by ``values`` (its own dict: FX copies meta shallowly)."""
    for key in values:
        _known(owner, key)
    owner.meta[_KEY] = dict(values)
