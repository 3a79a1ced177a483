"""Analyse pass: whole-model facts that the later passes' rewrites would hide.

Requires: the loss pass's ``(loss_sum, num_tokens)`` outputs, on the whole (unsharded,
unsplit) graph.
Ensures: the graph is unchanged; ``gm.meta["fxmeg"]["facts"]`` is a
``fxmeg.ir.program.ModelFacts``: the forward FLOPs of one micro-batch (matmuls and
attention, for throughput and MFU), and which inputs index a loss's classes or an
embedding's rows with their valid range (batches are checked against them before any
communication: out of range they would fail deep in one stage's forward while the
other ranks wait), and which tables bound the sequence length (a position embedding
indexed by ``arange(s)``, a rotary or mask table sliced to ``s``; checked before a
batch of another length is compiled).
"""

from __future__ import annotations

from torch import fx

from fxmeg.ir.program import ModelFacts, PositionTable, ValueCheck
from fxmeg.ir.tags import set_tag, tag
from fxmeg.passes.partition import node_flops
from fxmeg.torch_private import op_schema


def analyse(gm: fx.GraphModule) -> fx.GraphModule:
    flops = sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function")
    set_tag(gm, "facts", ModelFacts(flops, tuple(value_checks(gm)), tuple(position_tables(gm))))
    return gm


_PASS_THROUGH = {
    "view", "reshape", "_unsafe_view", "flatten", "to", "_to_copy", "contiguous", "clone",
    "alias", "slice", "unsqueeze", "squeeze", "pad", "constant_pad_nd", "expand",
}


def value_checks(gm: fx.GraphModule) -> list[ValueCheck]:
    """Which inputs index a loss's classes or an embedding's rows (through views, casts,
    slices and padding), with their valid range; for checking batches up front."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for node in gm.graph.nodes:
        schema = op_schema(node.target)
        name = schema.name if schema else ""
        if name in ("aten::cross_entropy_loss", "aten::nll_loss_nd", "aten::nll_loss"):
            source = _source(node.args[1], inputs)
            ignore = node.args[4] if len(node.args) > 4 else -100
            if source is not None:
                classes = (
                    node.args[0].meta["val"].shape[1 if node.args[0].meta["val"].dim() > 1 else 0]
                )
                out.append(ValueCheck(source, classes, ignore, "labels (classes of the loss)"))
        elif name == "aten::embedding":
            source = _source(node.args[1], inputs)
            if source is not None:
                rows = node.args[0].meta["val"].shape[0]
                module = tag(node, "module", "")
                out.append(
                    ValueCheck(source, rows, None, f"token ids (rows of embedding {module!r})")
                )
    return out


def _source(node, inputs: list[fx.Node]) -> int | None:
    while isinstance(node, fx.Node) and node.op == "call_function":
        base = getattr(node.target, "__name__", "").split(".")[0]
        if base not in _PASS_THROUGH:
            return None
        node = node.args[0]
    return inputs.index(node) if isinstance(node, fx.Node) and node in inputs else None


def position_tables(gm: fx.GraphModule) -> list[PositionTable]:
    """Tables read one row per sequence position: an embedding whose indices come from
    ``arange(s)`` (through views), and a model tensor sliced to ``[:s]`` along a
    dimension; ``s`` being the size of some input's dimension (not the batch's), which is
    then the sequence the table bounds."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shapes = [tuple(n.meta["val"].shape) if "val" in n.meta else () for n in inputs]
    found: list[tuple[str, int, int]] = []  # (what, rows, s)
    for node in gm.graph.nodes:
        schema = op_schema(node.target)
        name = schema.name if schema else ""
        if name == "aten::embedding":
            end = _arange_end(node.args[1])
            if end is not None:
                module = tag(node, "module", "")
                found.append(
                    (f"position embedding {module!r}", node.args[0].meta["val"].shape[0], end)
                )
        elif name == "aten::slice" and node.args[0].op == "get_attr" and len(node.args) > 3:
            dim, start, end = node.args[1], node.args[2], node.args[3]
            if start == 0 and isinstance(end, int):
                rows = node.args[0].meta["val"].shape[dim]
                found.append((f"table {node.args[0].target!r} (dimension {dim})", rows, end))
    out = []
    for what, rows, end in found:
        where = next(
            (
                (i, d)
                for i, shape in enumerate(shapes)
                for d in range(1, len(shape))
                if shape[d] == end
            ),
            None,
        )
        if where is not None:
            out.append(PositionTable(what, rows, *where))
    return out


def _arange_end(node) -> int | None:
    """One past the largest value of the ``arange(end)`` / ``arange(0, end)`` that
    ``node`` is a view of, plus any integer added on the way (Hugging Face adds the
    cache's length, 0 in training)."""
    offset = 0
    while isinstance(node, fx.Node) and node.op == "call_function":
        base = getattr(node.target, "__name__", "").split(".")[0]
        if base == "arange":
            args = node.args
            bounds = args if len(args) >= 2 else (0, *args)
            if bounds[0] == 0 and isinstance(bounds[1], int) and len(args) <= 2:
                return bounds[1] + offset
            return None
        if (
            base == "add"
            and len(node.args) == 2
            and isinstance(node.args[1], int)
            and not node.kwargs
        ):
            offset += node.args[1]
        elif base not in _PASS_THROUGH:
            return None
        node = node.args[0]
    return None
