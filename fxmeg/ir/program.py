"""The Program: the frozen record the passes produce and every rank's runtime reads
(docs/architecture.md §2). It holds no rank: the same Program on every rank, from which
``fxmeg.runtime.context.build_context`` makes this rank's objects.

Metadata the passes write on nodes and graphs: fxmeg/ir/tags.py, its only accessors
(each key and its type; docs/architecture.md §2's table says who writes and reads it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from fxmeg.ir.layouts import CPLayout, ExpertShard, ParamLayout  # noqa: F401  (CPLayout: Program.cp_layout)
from fxmeg.ir.tags import has_tag, tag

if TYPE_CHECKING:
    from fxmeg.config import EngineConfig


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
    """The calling convention of one chunk graph:
    ``gm(*data, *recv) -> (*send[, loss_sum, num_tokens])``."""

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


@dataclass(frozen=True)
class SplitSpec:
    """The calling conventions of a chunk's forward, input-gradient and weight-gradient
    graphs (the split_backward pass, zero-bubble schedules):

      zb_forward(*state, *data, *recv) -> (*outputs, *saved)
      zb_input(*saved, *tangents)      -> (*recv_grads, *carry)
      zb_weight(*carry)                -> (*weight_grads)

    ``outputs`` are the chunk's own (sends, then loss_sum and num_tokens on the last);
    ``recv_grads`` one per received tensor that sends a gradient back (None where it
    gets none); ``weight_grads`` one per name in ``weights``."""

    state: tuple[str, ...]
    """Parameters then buffers, by name: the first inputs of zb_forward."""
    saved: int
    tangents: int
    outputs: int
    weights: tuple[str, ...]
    carry: int
    tangent_of: tuple[int, ...]
    """For each tangent, the index of the output it is the gradient of."""


def split_spec(gm: fx.GraphModule) -> SplitSpec | None:
    """The split the split_backward pass stored on a chunk graph, if any."""
    return tag(gm, "split")


def chunk_spec(gm: fx.GraphModule) -> ChunkSpec:
    """The calling convention the pipeline pass stored on a chunk graph."""
    return tag(gm, "spec")


def chunk_name(index: int) -> str:
    """The name of chunk ``index``'s submodule under the pipelined parent graph (the
    pipeline pass names them; nothing parses the name: ``chunks`` finds them by spec)."""
    return f"chunk_{index}"


def chunks(parent: fx.GraphModule) -> list[fx.GraphModule]:
    """The chunk graphs of a pipelined parent graph, in chunk order: its submodules that
    carry a ChunkSpec. Empty for a graph the pipeline pass has not split (a user module
    may be called ``chunk_0`` there)."""
    found = {chunk_spec(m).index: m for m in parent.children()
             if isinstance(m, fx.GraphModule) and has_tag(m, "spec")}
    return [found[i] for i in range(len(found))]


@dataclass(frozen=True)
class ChunkInfo:
    """Where a chunk graph sits in the pipeline: what the driver tells a per-chunk pass
    besides the graph itself (fxmeg/frontend/pass_driver.py)."""

    index: int
    """Chunk index in model order, 0 .. num_chunks - 1."""
    pp_rank: int
    """The pipeline rank that runs it (``Partition.placement[index]``)."""
    num_chunks: int
    """pp * vpp."""


def chunk_infos(parent: fx.GraphModule) -> tuple[ChunkInfo, ...]:
    """One ChunkInfo per chunk of a pipelined parent graph, from its partition's placement."""
    placement = tag(parent, "partition").placement
    return tuple(ChunkInfo(c, rank, len(placement)) for c, rank in enumerate(placement))


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
    experts: bool = False
    """Banks of routed experts (ep > 1): reduced and sharded over the expert-data-parallel
    ranks, not over dp x cp."""

    def slot(self, name: str) -> Slot:
        return next(s for s in self.slots if s.name == name)


def buffer_layouts(gm: fx.GraphModule) -> tuple[BufferLayout, ...]:
    """The gradient buffers the bucket pass laid out for a chunk graph."""
    return tag(gm, "buffers", ())


def load_marks(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``fxmeg.ir.ops.expert_load`` nodes of a chunk graph (expert_parallel pass), those
    moved into its recompute regions included, in graph order."""
    from fxmeg.ir import ops

    return [n for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
            if n.op == "call_function" and n.target is ops.expert_load]


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
class Partition:
    """Which units each chunk holds, and what each chunk is estimated to cost."""

    blocks: tuple[str, ...]
    """Block FQNs in execution order."""
    units: tuple[str, ...]
    """Unit names in execution order: a block (``layers.3``), or a residual-stream point
    inside or after one (``layers.3:ln_2``: from that child of layers.3 on)."""
    starts: tuple[int, ...]
    """Index in ``units`` of the first unit of each chunk."""
    costs: tuple[float, ...]
    """Estimated forward cost of each chunk (FLOPs + BYTE_COST * bytes moved)."""
    unit_costs: tuple[float, ...] = ()
    placement: tuple[int, ...] = ()
    """Pipeline rank of each chunk."""

    def chunk_units(self, chunk: int) -> tuple[str, ...]:
        end = self.starts[chunk + 1] if chunk + 1 < len(self.starts) else len(self.units)
        return self.units[self.starts[chunk] : end]

    def chunk_blocks(self, chunk: int) -> tuple[str, ...]:
        """Blocks with code in ``chunk`` (a block cut at a residual point is in two)."""
        names = (u.split(":")[0] for u in self.chunk_units(chunk))
        return tuple(dict.fromkeys(b for b in names if b in self.blocks))


@dataclass(frozen=True)
class InputSpec:
    """One input of the example micro-batch: batches must match it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


CONSTANTS = "_fxmeg_constants."
"""Name prefix of the tensor constants a forward creates (lifted by export): values of one
capture, not model state (a Program of another input shape has its own). Here, not in
capture, because the runtime reads it too and must not import capture."""


@dataclass(frozen=True)
class CaptureInfo:
    """What capture knew about the user's model, kept on the captured graph."""

    inputs: tuple[InputSpec, ...]
    aliases: Mapping[str, tuple[str, ...]]
    """Canonical FQN -> every name the user's ``state_dict`` has for that tensor."""
    explicit_loss: bool
    """The outputs already are ``(loss_sum, num_tokens)`` (a user ``loss_fn``)."""
    keywords: bool = False
    """The example was a dict: the inputs are passed by keyword, batches are dicts."""


@dataclass(frozen=True)
class ModelFacts:
    """Whole-model facts the analyse pass records before the graph is split."""

    flops_per_microbatch: float
    """Forward FLOPs of the whole model on one micro-batch (matmuls and attention)."""
    value_checks: tuple[ValueCheck, ...]
    position_tables: tuple[PositionTable, ...] = ()


@dataclass(frozen=True)
class PositionTable:
    """A table the model reads one row of per sequence position (a learned position
    embedding indexed by ``arange(s)``, a rotary table sliced to ``[:s]``): the sequence,
    dimension ``dim`` of input ``index``, may be at most ``rows`` long."""

    what: str
    rows: int
    index: int
    dim: int


@dataclass(frozen=True)
class ValueCheck:
    """Input ``index`` must hold values in [0, high) (``ignore`` allowed too)."""

    index: int
    high: int
    ignore: int | None
    what: str
    """'labels (classes of the loss)' or 'token ids (rows of embedding X)'."""


TPSpec = ParamLayout
"""A parameter's tensor-parallel layout: ``Shard(dim, parts)`` (split along ``dim``, each
block of ``parts`` cut in tp equal pieces) or ``Replicate(reduce_grad)`` (whole on every
tp rank; reduce_grad when its gradient differs per rank and is all-reduced over tp)."""


@dataclass(frozen=True)
class Program:
    """A transformed model, identical on every rank (docs/architecture.md §2). Built by
    ``fxmeg.transform``; read by ``fxmeg.runtime.context.build_context``."""

    config: EngineConfig
    """The configuration it was transformed for (the runtime may change only the global
    batch size)."""
    graph: fx.GraphModule
    """The parent graph: submodules ``chunk_0 ..`` chained, computing what the model does."""
    chunks: tuple[fx.GraphModule, ...]
    """Chunk graphs in chunk order; their parameters are the user's, full size."""
    specs: tuple[ChunkSpec, ...]
    """Each chunk's calling convention."""
    buffers: tuple[tuple[BufferLayout, ...], ...]
    """Each chunk's gradient buffers (one per gradient dtype)."""
    placement: tuple[int, ...]
    """Pipeline rank of each chunk."""
    partition: Partition
    tp_specs: Mapping[str, TPSpec]
    """Parameter FQN -> how the tensor-parallel pass shards it (empty for tp=1)."""
    ep_specs: Mapping[str, ExpertShard]
    """Parameter FQN of a routed-experts bank -> its split over ep ranks (empty for ep=1)."""
    holders: Mapping[str, tuple[int, ...]]
    """Trainable parameter FQN -> sorted pipeline ranks whose chunks read it."""
    parameters: Mapping[str, nn.Parameter]
    """Trainable parameter FQN -> the user's parameter (what the runtime materialises; a
    meta tensor for a model built on meta). Once ``build_context(..., model=)`` made this
    rank's tensors: the rank's own Parameter, or a meta tensor for what it does not hold
    (runtime/release.py; so are the graphs' tensors)."""
    master_values: Mapping[str, torch.Tensor]
    """Half precision: each parameter's fp32 tensor from before the model was cast (the
    user's own storage, not a copy; empty in fp32, and emptied once the rank's masters
    are made)."""
    untrained: Mapping[str, torch.Tensor]
    """State-dict entries no chunk trains (buffers, frozen parameters), as the model has them."""
    aliases: Mapping[str, tuple[str, ...]]
    """Canonical FQN -> every name the user's ``state_dict`` has for that tensor."""
    full_shapes: Mapping[str, tuple[torch.Size, torch.dtype]]
    """Every state-dict name -> its full (unsharded) shape and dtype."""
    inputs: tuple[InputSpec, ...]
    """The example micro-batch's inputs (a dict example: named by its keys, in its order)."""
    value_checks: tuple[ValueCheck, ...]
    flops_per_microbatch: float
    aux_scale: tuple[int, str] | None
    """(chunk, buffer name) of the auxiliary-loss weight the runtime sets, if any."""
    device: torch.device
    reference: fx.GraphModule | None = None
    """The whole-model graph right after the analyse pass (``(loss_sum, num_tokens)``
    outputs, no parallel rewrite), holding the user's tensors: the single-device oracle
    of ``Engine.verify``."""
    init_dtypes: Mapping[str, torch.dtype] = dataclasses.field(default_factory=dict)
    """Every parameter and buffer (by its first name) -> its dtype as the user built the
    model, before the precision cast: the dtype a meta model is initialised or loaded in."""
    keywords: bool = False
    """The example was a dict: batches are dicts with the keys of ``inputs``, passed to
    the model by keyword (``fxmeg.runtime.batches.positional`` orders them)."""
    position_tables: tuple[PositionTable, ...] = ()
    """What bounds the sequence length (``EngineConfig.variable_seq_lengths``)."""
    tp_whole: tuple[tuple[str, str], ...] = ()
    """(module glob, why) of every block's projection tp > 1 leaves whole on every tp rank
    (fxmeg/passes/tp/heads.py: key/value heads fewer than tp, tp_plan, no linear to split)."""
    cp_layout: CPLayout | None = None
    """cp > 1: the context-parallel pass's ``CPLayout`` (sequence length, and the dim of
    each input the runtime cuts to this cp rank's positions); None otherwise."""
    unread: tuple[str, ...] = ()
    """Trainable parameters of the model (first names) that no chunk graph reads: they get
    no gradient and no update (plain PyTorch leaves their ``grad`` None); ``Engine.verify``
    reports them."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def chunks_of(self, pp_rank: int) -> list[int]:
        """The chunks pipeline rank ``pp_rank`` runs, in chunk order."""
        return [c for c, r in enumerate(self.placement) if r == pp_rank]

    @property
    def grad_cuts(self) -> frozenset[int]:
        """Cuts c (between chunks c and c + 1) across which a gradient flows back: what
        the schedule's lowering sends and receives in backward."""
        return frozenset(
            c for c, spec in enumerate(self.specs[1:]) if any(b.grad for b in spec.recv)
        )

    def __str__(self) -> str:
        par = self.config.parallel
        lines = [
            f"Program: {self.num_chunks} chunk(s) over pp={par.pp} (vpp={par.vpp}), tp={par.tp}, "
            f"dp={par.dp}; {self.flops_per_microbatch / 1e6:.1f} MFLOP forward per micro-batch"
        ]
        for c, spec in enumerate(self.specs):
            units = self.partition.chunk_units(c)
            span = f"{units[0]} .. {units[-1]}" if len(units) > 1 else (units[0] if units else "-")
            names = [n for n in self.parameters if self.placement[c] in self.holders[n]
                     and n in dict(self.chunks[c].named_parameters())]
            elements = sum(self.full_shapes[n][0].numel() for n in names if n in self.full_shapes)
            buckets = sum(len(b.buckets) for b in self.buffers[c])
            lines.append(
                f"  chunk {c} on pp rank {self.placement[c]}: units {span} ({len(units)}), "
                f"{len(names)} parameters ({elements:,} elements), {buckets} bucket(s), "
                f"recv {len(spec.recv)} / send {len(spec.send)} tensors"
                + (", returns the loss" if spec.is_last else "")
            )
        for stage in range(par.pp):
            names = [n for n, h in self.holders.items() if stage in h]
            lines.append(f"  pp rank {stage}: {len(names)} trainable parameters")
        return "\n".join(lines)
