"""Partition: a cost model over the captured graph and a balanced cut into pipeline chunks.

Glossary:
  block   one repeated layer, found from module FQNs: the children of the module list
          with the most numbered children (``layers.3``, ``h.3``, ``model.layers.3``);
  unit    what a cut may separate: a block, or the part of one from a residual-stream
          point on (between attention and MLP; before the final norm or head), where
          no more bytes are live than enter the block; code before the first block
          (embeddings, rotary tables) joins the first unit;
  chunk   a contiguous run of units; chunk c runs on pipeline rank placement[c]
          (``ParallelConfig.placement``: c % pp, round robin, Megatron's virtual
          pipeline order; a V for the zbv and dualpipev schedules).

A higher-order op (an autocast or no-grad region, ``wrap``) is one node of the unit it
runs in: the nodes of its body are never cut apart, and its cost is theirs.

Requires: the loss pass's outputs; tp-sharded shapes in ``meta["val"]`` if tp > 1.
Ensures: every call_function node carries ``meta["fxmeg"]["chunk"]`` in
[0, pp * vpp), non-decreasing in graph order, so chunks only ever read values of earlier
chunks and the pipeline pass can cut between them; ``gm.meta["fxmeg"]["partition"]`` is
the ``fxmeg.ir.program.Partition`` (units, chunk starts, estimated costs, placement).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import torch
from torch import fx

from fxmeg.config import ParallelConfig
from fxmeg.errors import ConfigError, PassError
from fxmeg.frontend.capture import owning_module
from fxmeg.frontend.model_checks import blocks_error
from fxmeg.ir import ops
from fxmeg.ir.program import Partition
from fxmeg.ir.tags import set_tag
from fxmeg.passes.graph_utils import bound, is_hop, subgraphs, val
from fxmeg.torch_private import is_alias_of, op_schema

aten = torch.ops.aten

BYTE_COST = 32.0
"""Cost of moving one byte, in FLOPs: a middle ground between a GPU (~300 FLOPs per byte
of memory bandwidth) and a CPU (~10)."""

_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")
_MATMULS = (aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default)
# torch's grouped matmul, and transformers' own op where torch's does not run (fp32, a CPU)
_GROUPED_MM = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")


def partition(gm: fx.GraphModule, parallel: ParallelConfig) -> fx.GraphModule:
    """Cut ``gm`` into pp * vpp chunks at unit boundaries (balanced; under a V schedule
    over the pipeline ranks; or at the layout's ``split_points``); tag every node's chunk."""
    par = parallel
    v = (
        par.spec.placement == "v"
    )  # a rank runs its two chunks back to back (fxmeg/schedule_registry.py)
    split = cut(
        gm,
        num_chunks=par.num_chunks,
        split_points=par.split_points,
        placement=par.placement if v else None,
    )
    set_tag(gm, "partition", dataclasses.replace(split, placement=par.placement))
    return gm


def cut(
    gm: fx.GraphModule,
    *,
    num_chunks: int,
    split_points: tuple[str, ...] | None = None,
    placement: tuple[int, ...] | None = None,
) -> Partition:
    """The cut into ``num_chunks`` chunks; tags every node's chunk. With a ``placement``
    that puts several chunks on a rank, the busiest rank's estimated cost is what the
    balanced cut minimises first (``_rank_balanced``; ``partition`` passes it for the V
    schedules)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    blocks, units, unit_of = _units(nodes)
    # model_checks refused most before capture; the graph may hold fewer
    error = blocks_error(num_chunks, blocks)
    if error is not None:
        raise error
    starts = (0,)
    unit_costs = [0.0] * max(len(units), 1)
    for node in nodes:
        unit_costs[unit_of[node]] += node_cost(node)
    if num_chunks > 1:
        if split_points is not None:
            starts = _pinned_starts(blocks, units, split_points, num_chunks)
        else:
            starts = _block_starts(units, set(blocks), unit_costs, num_chunks, placement)
    chunk_of_unit = [0] * len(unit_costs)
    for chunk, start in enumerate(starts):
        for unit in range(start, len(unit_costs)):
            chunk_of_unit[unit] = chunk
    for node in nodes:
        set_tag(node, "chunk", chunk_of_unit[unit_of[node]])
    costs = [0.0] * num_chunks
    for unit, cost in enumerate(unit_costs):
        costs[chunk_of_unit[unit]] += cost
    return Partition(tuple(blocks), tuple(units), tuple(starts), tuple(costs), tuple(unit_costs))


def node_flops(node: fx.Node) -> float:
    """Forward FLOPs of a matmul-like node (linear, matmul, attention); 0 for the rest.
    Attention counts QK^T and AV over the full square (as Megatron's formula does). A
    higher-order op (an autocast or no-grad region) counts its bodies' nodes. A size that
    depends on the data counts at its upper bound (``graph_utils.bound``)."""
    return bound(_flops(node))


def _flops(node: fx.Node):
    if is_hop(node):
        return sum(node_flops(n) for n in _body_nodes(node))
    out = val(node)
    ins = [val(n) for n in node.all_input_nodes]
    if node.target == aten.linear.default:
        return 2.0 * out.numel() * ins[0].shape[-1]
    # by argument position: a node read twice (self-attention on one tensor, x @ x) is one
    # input node
    if node.target in _MATMULS:
        return (
            2.0
            * out.numel()
            * val(node.args[1 if node.target == aten.addmm.default else 0]).shape[-1]
        )
    if node.target == aten.scaled_dot_product_attention.default:
        q, k = val(node.args[0]), val(node.args[1])
        return 4.0 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1]
    # rows each through one expert's weight (transformers' MoE experts): as a matmul
    schema = op_schema(node.target)
    if schema is not None and schema.name in _GROUPED_MM:
        return 2.0 * out.numel() * val(node.args[0]).shape[-1]
    # every routed (token, expert) row through its expert's two matmuls; under ep a rank
    # computes as many rows as it routes (balanced routing: docs/planner.md)
    if node.target in (ops.routed_experts, ops.routed_experts_split):
        rows, up, down = (val(node.args[i]) for i in (2, 4, 5))
        return 2.0 * rows.numel() * (up.shape[-2] * up.shape[-1] + down.shape[-2] * down.shape[-1])
    # local queries against all cp ranks' keys
    if node.target == torch.ops.fxmeg.cp_attention.default:
        q, k = val(node.args[0]), val(node.args[1])
        return 4.0 * q.shape[:-1].numel() * k.shape[-2] * node.args[5] * q.shape[-1]
    if node.target == torch.ops.fxmeg.cp_ring_attention.default:  # every ring step's keys
        q, k = val(node.args[0]), val(node.args[1])
        steps = node.args[7] // node.args[8]
        return 4.0 * q.shape[:-1].numel() * k.shape[-2] * steps * q.shape[-1]
    return 0.0


def node_cost(node: fx.Node) -> float:
    """Forward cost of one node: FLOPs of matmuls and attention, plus bytes moved (a
    higher-order op: the sum over its bodies' nodes)."""
    if is_hop(node):
        return sum(node_cost(n) for n in _body_nodes(node))
    return node_flops(node) + BYTE_COST * node_bytes(node)


def node_bytes(node: fx.Node) -> int:
    """Bytes one node reads and writes (0 for a view; a higher-order op: its bodies')."""
    if is_hop(node):
        return sum(node_bytes(n) for n in _body_nodes(node))
    out = val(node)
    ins = [val(n) for n in node.all_input_nodes]
    moved = sum(t.numel() * t.element_size() for t in (out, *ins) if isinstance(t, torch.Tensor))
    if node.target == aten.embedding.default:  # reads only the looked-up rows
        moved = 2 * out.numel() * out.element_size()
    if _is_view(node):
        moved = 0
    return bound(moved)


def _is_view(node: fx.Node) -> bool:
    """True when every tensor ``node`` returns shares storage with one it reads (a view,
    transpose, split, or a reshape or flatten that needed no copy, as the traced shapes
    and strides say): it moves no bytes. The partition counted them as copies, which
    made an attention block (a dozen reshapes) look 1.8x as costly as its MLP half."""
    schema = op_schema(node.target)
    if schema is not None and schema.is_mutable:
        return False

    def tensors(v) -> list[torch.Tensor]:  # a split's val is a list of them
        return [
            t for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)
        ]

    outs = tensors(node.meta.get("val"))
    srcs = [t for n in node.all_input_nodes for t in tensors(n.meta.get("val"))]
    return bool(outs) and all(any(is_alias_of(o, s) for s in srcs) for o in outs)


def _body_nodes(node: fx.Node) -> list[fx.Node]:
    return [n for body in subgraphs(node) for n in body.graph.nodes if n.op == "call_function"]


def find_blocks(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The block (e.g. 'layers.3') of every call_function node created inside one: blocks
    are the numbered children of the module list with the most of them."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    numbered = {n: _NUMBERED.match(owning_module(n)) for n in nodes}
    per_list = Counter(c for c, _ in {(m[1], m[2]) for m in numbered.values() if m})
    container = max(per_list, key=lambda c: (per_list[c], -len(c)), default=None)
    return {n: f"{m[1]}.{m[2]}" for n, m in numbered.items() if m and m[1] == container}


def _units(nodes: list[fx.Node]) -> tuple[list[str], list[str], dict[fx.Node, int]]:
    """Blocks in execution order, units in execution order, and every node's unit.

    Code before the first block joins it. A unit starts at every later block, and inside
    or after a block at each change of child module (``attn`` -> ``ln_2``, ``layers.3``
    -> ``ln_f``) where the values live across the point take no more bytes than those
    entering the block: the residual stream between attention and MLP, or before the
    final norm or head. Cutting there sends no more than cutting between blocks."""
    block_of = find_blocks(nodes[0].graph.owning_module) if nodes else {}
    blocks: list[str] = []
    block_index: dict[fx.Node, int] = {}
    current = 0
    for node in nodes:
        name = block_of.get(node)
        if name is not None:
            if name not in blocks:
                blocks.append(name)
            current = blocks.index(name)
        block_index[node] = current
        if node.target.__name__ == "getitem":  # a tuple's parts stay with the tuple
            block_index[node] = block_index[node.args[0]]
        earlier = [block_index[n] for n in node.all_input_nodes if n in block_index]
        if earlier and max(earlier) > block_index[node]:
            raise PassError(
                f"node {node.name!r} (module {owning_module(node)!r}) reads a value of a "
                f"later block ({blocks[max(earlier)]}); fxmeg pipelines models whose blocks "
                "run one after the other"
            )
    live = _live_bytes(nodes)
    units = [blocks[0]] if blocks else ["model"]
    unit_of: dict[fx.Node, int] = {}
    entering = None  # bytes live where the current block starts
    for p, node in enumerate(nodes):
        prev = nodes[p - 1] if p else None
        if node in block_of and entering is None:
            entering = live[p]  # the first block (code before it is in its unit)
        elif prev is not None and block_index[node] != block_index[prev]:
            units.append(blocks[block_index[node]])
            entering = live[p]
        elif (entering is not None and node.target.__name__ != "getitem"
              and _part(prev, block_of) != _part(node, block_of) and live[p] <= entering):
            part = _part(node, block_of)
            outside = part.startswith("~")
            name = (
                (part[1:] or f"{blocks[-1]}:after")
                if outside
                else f"{blocks[block_index[node]]}:{part or 'residual'}"
            )
            units.append(name)
        unit_of[node] = len(units) - 1
        if node.target.__name__ == "getitem":
            unit_of[node] = unit_of[node.args[0]]
    return blocks, units, unit_of


def _part(node: fx.Node, block_of: dict[fx.Node, str]) -> str:
    """The child module of its block that ``node`` runs in ('' for the block's own code);
    for code outside blocks, its module."""
    module, block = owning_module(node), block_of.get(node)
    if block is None:
        return "~" + module
    rest = module[len(block) + 1 :]
    return rest.split(".")[0]


def _live_bytes(nodes: list[fx.Node]) -> list[int]:
    """live[p]: bytes of values made before ``nodes[p]`` and read at or after it."""
    index = {n: i for i, n in enumerate(nodes)}
    delta = [0] * (len(nodes) + 2)
    for i, node in enumerate(nodes):
        v = val(node)
        if v is None or not node.users:
            continue
        last = max(index.get(u, len(nodes)) for u in node.users)
        if last > i:
            delta[i + 1] += v.numel() * v.element_size()
            delta[last + 1] -= v.numel() * v.element_size()
    live, total = [], 0
    for p in range(len(nodes)):
        total += delta[p]
        live.append(total)
    return live


BLOCK_SLACK = 0.10
"""How much busier (estimated) the busiest chunk or rank may be when cut at block
boundaries than when cut at any unit, before the cut goes inside a block."""


def _block_starts(units: list[str], blocks: set[str], costs: list[float], k: int,
                  placement: tuple[int, ...] | None) -> tuple[int, ...]:
    """The balanced cut at block boundaries (as Megatron's, and what split_points name),
    unless that leaves the busiest chunk (rank, in a V) more than ``BLOCK_SLACK`` costlier
    than the best cut at any unit: a heavy head on few blocks (the 4-layer benchmark GPT:
    0.078 / 0.114 s a stage cut at blocks, 0.096 / 0.093 s inside one). Llama-3-70B at
    pp=8 cuts at blocks (model.layers.60:post_attention_layernorm before)."""
    v = placement is not None and len(set(placement)) < k

    def balanced(c: list[float]) -> tuple[int, ...]:
        starts = _balanced_starts(c, k)
        return _rank_balanced(starts, c, placement) if v else starts

    def score(starts: tuple[int, ...]) -> float:
        chunks = [sum(costs[a:b]) for a, b in zip(starts, (*starts[1:], len(costs)))]
        if not v:
            return max(chunks)
        loads = [0.0] * (max(placement) + 1)
        for chunk, cost in enumerate(chunks):
            loads[placement[chunk]] += cost
        return max(loads)

    anywhere = balanced(costs)
    at = [i for i, u in enumerate(units) if u in blocks]
    if len(at) < k:
        return anywhere
    grouped = [sum(costs[a:b]) for a, b in zip(at, (*at[1:], len(costs)))]
    grouped[0] += sum(costs[: at[0]])
    on_blocks = tuple(0 if j == 0 else at[j] for j in balanced(grouped))
    return on_blocks if score(on_blocks) <= (1 + BLOCK_SLACK) * score(anywhere) else anywhere


def _balanced_starts(costs: list[float], k: int) -> tuple[int, ...]:
    """Cut ``costs`` into k contiguous non-empty runs minimising the largest run's sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[j][i]: minimal max-run cost of splitting units [0, i) into j runs
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                cost = max(best[j - 1][s], prefix[i] - prefix[s])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, s
    starts, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return tuple(reversed(starts))


SEARCH_BUDGET = 200_000
"""Cuts ``_rank_balanced`` may visit (about 0.3 s); the best found by then is kept."""


def _rank_balanced(
    starts: tuple[int, ...], costs: list[float], placement: tuple[int, ...]
) -> tuple[int, ...]:
    """The cut whose busiest pipeline rank (the sum of the costs of the chunks
    ``placement`` puts on it) costs least, ties to the smaller largest chunk; starting
    from the chunk-balanced ``starts``, never worse. In a V (chunks 0 and 2pp-1 on rank 0,
    the middle ones on pp-1) a rank runs its two chunks back to back, so its load sets its
    pace, and even chunks can leave one rank 40% busier than the other (bench GPT, pp=2;
    zbv and dualpipev ran 4-6% faster with the ranks evened). The interleaved schedule
    keeps even chunks: its ranks take turns chunk by chunk, and evened ranks of very
    uneven chunks measured no faster there.

    Branch and bound over each chunk's end in order: a chunk that lifts its rank past the
    best cut so far ends the branch, and so does a remainder larger than the room left
    under that bound on all ranks. Exact for the models tested (brute force agrees);
    past ``SEARCH_BUDGET`` visits it returns the best found, the same on every rank."""
    n, k = len(costs), len(placement)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def score(cut: tuple[int, ...]) -> tuple[float, float]:
        chunks = [prefix[b] - prefix[a] for a, b in zip(cut, (*cut[1:], n))]
        loads = [0.0] * (max(placement) + 1)
        for chunk, cost in enumerate(chunks):
            loads[placement[chunk]] += cost
        return max(loads), max(chunks)

    best_score, best_cut = score(starts), starts
    loads, cut, visits = [0.0] * (max(placement) + 1), [0] * k, SEARCH_BUDGET

    def extend(j: int, largest: float) -> None:  # chunk j starts at cut[j]
        nonlocal best_score, best_cut, visits
        visits -= 1
        rank, first = placement[j], cut[j]
        if j == k - 1:
            c = prefix[n] - prefix[first]
            found = (max(*loads, loads[rank] + c), max(largest, c))
            if found < best_score:
                best_score, best_cut = found, tuple(cut)
            return
        for end in range(first + 1, n - (k - 1 - j) + 1):
            c = prefix[end] - prefix[first]
            if visits <= 0 or loads[rank] + c > best_score[0]:
                return
            loads[rank] += c
            if sum(best_score[0] - x for x in loads) >= prefix[n] - prefix[end]:
                cut[j + 1] = end
                extend(j + 1, max(largest, c))
            loads[rank] -= c

    extend(0, 0.0)
    return best_cut


def _pinned_starts(
    blocks: list[str], units: list[str], split_points: tuple[str, ...], k: int
) -> tuple[int, ...]:
    if len(split_points) != k - 1:
        raise ConfigError(
            f"split_points has {len(split_points)} entries, but pp * vpp = {k} chunks need "
            f"{k - 1} (the first block of every chunk but the first)"
        )
    starts = [0]
    for name in split_points:
        if name not in units:
            inner = [u for u in units if ":" in u]
            raise ConfigError(
                f"split point {name!r} names no block; blocks are {blocks[0]} .. {blocks[-1]}"
                + (f" (and points inside them such as {inner[0]!r})" if inner else "")
            )
        starts.append(units.index(name))
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ConfigError(
            f"split_points {list(split_points)} must name blocks in increasing order, "
            f"none of them {blocks[0]}"
        )
    return tuple(starts)
