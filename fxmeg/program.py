"""The program: plain data that the passes produce and the runtime executes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx, nn


@dataclass(frozen=True)
class Boundary:
    """One tensor crossing from chunk ``src`` to chunk ``src + 1``."""

    name: str
    """Name of the value in the captured graph (the producing node)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool
    """Whether it requires grad, i.e. whether a gradient is sent back for it."""
    src: int
    """Chunk that sends it; ``src + 1`` receives it."""


@dataclass(frozen=True)
class ChunkSpec:
    """The calling convention of one chunk graph: ``gm(*data, *recv) -> (*send[, loss_sum, num_tokens])``."""

    index: int
    data_inputs: tuple[int, ...]
    """Indices into the micro-batch tuple of the inputs this chunk reads."""
    recv: tuple[Boundary, ...]
    """Tensors received from chunk ``index - 1``, in placeholder order."""
    send: tuple[Boundary, ...]
    """Tensors sent to chunk ``index + 1``, in output order."""
    deallocate: tuple[bool, ...]
    """Per sent tensor: the executor may free its storage once the send completed."""
    is_last: bool
    """The last chunk returns ``(loss_sum, num_tokens)`` after its sends."""


def chunk_spec(gm: fx.GraphModule) -> ChunkSpec:
    """The spec the pipeline pass stored on a chunk graph."""
    return gm.meta["fxmeg"]


def chunks(parent: fx.GraphModule) -> list[fx.GraphModule]:
    """The chunk graphs of a pipelined parent graph, in chunk order."""
    found = {int(name.split("_")[1]): m for name, m in parent.named_children() if name.startswith("chunk_")}
    return [found[i] for i in range(len(found))]


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient lives in its chunk's contiguous buffer."""

    name: str
    offset: int
    numel: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous range of a buffer reduced with one collective; ``end - start`` is a
    multiple of the data-parallel size (padding included)."""

    index: int
    start: int
    end: int
    params: tuple[str, ...]
    """In the order their gradients become ready in backward."""


@dataclass(frozen=True)
class BufferLayout:
    """One chunk's gradient buffer for one gradient dtype."""

    dtype: torch.dtype
    numel: int
    slots: tuple[Slot, ...]
    buckets: tuple[Bucket, ...]

    def slot(self, name: str) -> Slot:
        return next(s for s in self.slots if s.name == name)


def buffer_layouts(gm: fx.GraphModule) -> tuple[BufferLayout, ...]:
    """The gradient buffers the bucket pass laid out for a chunk graph."""
    return gm.meta.get("fxmeg_buffers", ())


def holders(chunks: list[fx.GraphModule], pp: int) -> dict[str, list[int]]:
    """Trainable parameter FQN -> sorted pipeline ranks whose chunks read it."""
    out: dict[str, set[int]] = {}
    for c, gm in enumerate(chunks):
        for name, p in gm.named_parameters():
            if p.requires_grad:
                out.setdefault(name, set()).add(c % pp)
    return {n: sorted(r) for n, r in out.items()}


def tp_specs(chunks: Iterable[fx.GraphModule]) -> dict[str, tuple]:
    """Parameter FQN -> its tensor-parallel tag from the TP pass (absent for tp=1)."""
    out = {}
    for gm in chunks:
        for node in gm.graph.nodes:
            if node.op == "get_attr" and "tp" in node.meta.get("fxmeg", {}):
                out[node.target] = node.meta["fxmeg"]["tp"]
    return out


def unique_parameters(chunks: Iterable[fx.GraphModule]) -> dict[str, nn.Parameter]:
    out: dict[str, nn.Parameter] = {}
    for gm in chunks:
        for name, p in gm.named_parameters():
            if p.requires_grad:
                out.setdefault(name, p)
    return out


def token_counter(gm: fx.GraphModule) -> fx.GraphModule:
    """The part of the last chunk graph that computes ``num_tokens``, as a graph taking
    the chunk's data inputs: the token count of a micro-batch without running the model
    (needed before the step when an auxiliary loss is weighted by it)."""
    from fxmeg.errors import PassError

    spec = chunk_spec(gm)
    target = gm.graph.output_node().args[0][-1]
    needed, todo = set(), [target]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    data = placeholders[: len(spec.data_inputs)]
    if any(n.op == "placeholder" and n not in data for n in needed):
        raise PassError("num_tokens depends on a value received from another pipeline stage; "
                        "it must be computable from the batch (labels or a mask)")
    graph, env = fx.Graph(), {}
    for n in gm.graph.nodes:
        if n in data:
            env[n] = graph.placeholder(n.name)
        elif n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[target])
    return fx.GraphModule(gm, graph)


@dataclass(frozen=True)
class ValueCheck:
    """Input ``index`` must hold values in [0, high) (``ignore`` allowed too)."""

    index: int
    high: int
    ignore: int | None
    what: str
    """'labels (classes of the loss)' or 'token ids (rows of embedding X)'."""


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
        schema = getattr(node.target, "_schema", None)
        name = schema.name if schema else ""
        if name in ("aten::cross_entropy_loss", "aten::nll_loss_nd", "aten::nll_loss"):
            source = _source(node.args[1], inputs)
            ignore = node.args[4] if len(node.args) > 4 else -100
            if source is not None:
                classes = node.args[0].meta["val"].shape[1 if node.args[0].meta["val"].dim() > 1 else 0]
                out.append(ValueCheck(source, classes, ignore, "labels (classes of the loss)"))
        elif name == "aten::embedding":
            source = _source(node.args[1], inputs)
            if source is not None:
                rows = node.args[0].meta["val"].shape[0]
                module = node.meta.get("fxmeg", {}).get("module", "")
                out.append(ValueCheck(source, rows, None, f"token ids (rows of embedding {module!r})"))
    return out


def _source(node, inputs: list[fx.Node]) -> int | None:
    while isinstance(node, fx.Node) and node.op == "call_function":
        base = getattr(node.target, "__name__", "").split(".")[0]
        if base not in _PASS_THROUGH:
            return None
        node = node.args[0]
    return inputs.index(node) if isinstance(node, fx.Node) and node in inputs else None
