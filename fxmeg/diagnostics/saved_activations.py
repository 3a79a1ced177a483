"""What autograd keeps for backward, read off a chunk graph: ``fxmeg plan``'s activations.

Each op saves what its derivative formula reads (PyTorch's derivatives.yaml, in our
words): a linear or matmul its input (the weight is a parameter, counted apart), a
product both factors, silu / gelu / pow their input, rsqrt / softmax / sigmoid their
result, fused attention q, k, v, its output and the per-row log-sum-exp, a dropout its
mask; adds, casts, concatenations, views and fxmeg's collectives keep nothing. A view
keeps its base alive, so every saved tensor is counted once, as the value it aliases
(the ``_is_view`` rule of the partition: same storage by the traced shapes and strides).
A recompute region keeps its inputs, and while backward runs it again, its own saved
tensors (the largest region's, once). An op the table does not know counts its output
when that requires grad (an upper bound), named in the breakdown as such.

Measured against ``fxmeg.diagnostics.measured_activations.SavedBytes`` (what autograd really packs)
in tests/diagnostics/test_plan.py. Megatron's formula and its differences: docs/cli.md.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import fx

from fxmeg.frontend.capture import owning_module
from fxmeg.ir import ops
from fxmeg.passes.graph_utils import _grad_flow, attr, body_call, is_hop, requires_grad_nodes, val
from fxmeg.passes.partition import _is_view, find_blocks

aten = torch.ops.aten
_SAVE_INPUT = {
    "pow",
    "silu",
    "gelu",
    "softplus",
    "log",
    "sin",
    "cos",
    "erf",
    "abs",
    "log1p",
    "leaky_relu",
}
_SAVE_RESULT = {
    "rsqrt",
    "sqrt",
    "exp",
    "tanh",
    "sigmoid",
    "relu",
    "_softmax",
    "softmax",
    "_safe_softmax",
    "_log_softmax",
    "log_softmax",
}
_SAVE_NOTHING = {
    "add",
    "sub",
    "neg",
    "cat",
    "stack",
    "clone",
    "to",
    "_to_copy",
    "contiguous",
    "expand",
    "view",
    "reshape",
    "_unsafe_view",
    "transpose",
    "permute",
    "t",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "chunk",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "alias",
    "detach",
    "repeat",
    "mean",
    "sum",
    "zeros_like",
    "ones_like",
    "repeat_interleave",
    "new_zeros",
    "new_ones",
    "empty_like",
    "full_like",
    "lift_fresh_copy",
    "type_as",
    "fill",
    "sp_gather",
    "sp_scatter",
    "sp_whole",
    "sp_split",
    "tp_copy",
    "tp_reduce",
    "tp_slice",
    "tp_pad",
    "cp_slice",
    "cp_unslice",
    "cp_gather",
    "cp_to_heads",
    "cp_from_heads",
    "cp_reduce_scatter",
    "cp_all_reduce",
    "recv",
    "send",
    "deallocate",
}


@dataclass(frozen=True)
class Saved:
    """One tensor autograd keeps: ``module`` is the module of the op that keeps it (the
    first one, in graph order), ``what`` what it is to that op."""

    module: str
    what: str
    nbytes: int


def saved_tensors(gm: fx.GraphModule) -> list[Saved]:
    """Every tensor one micro-batch of chunk ``gm`` keeps for backward, each once."""
    seen: dict[object, Saved] = {}
    _walk(gm, requires_grad_nodes(gm), {}, seen)
    return list(seen.values())


def recompute_working_bytes(gm: fx.GraphModule) -> int:
    """What backward holds while it runs a recompute region again: the largest region's
    own saved tensors (once per stage, not per micro-batch in flight; 0 without recompute)."""
    return max((region_bytes(gm, n) for n in gm.graph.nodes
                if n.op == "call_module" and hasattr(attr(gm, n.target), "region")), default=0)


def attention_working_bytes(gm: fx.GraphModule) -> int:
    """The most one exchanged attention of ``gm`` (its recompute regions' too) holds for
    itself while its backward runs, beside what it saved (``attention_working``): once per
    stage in ``fxmeg plan``."""
    return max((attention_working(n) for m in gm.modules() if isinstance(m, fx.GraphModule)
                for n in m.graph.nodes), default=0)


def attention_working(node: fx.Node) -> int:
    """What ``node``'s backward holds for itself if it is an exchanged attention
    (docs/long-context.md), else 0:
      cp_attention (cp_comm_type all_gather): the whole sequence's keys and values, gathered,
        and five tensors of the fp32 scores of this rank's queries over every key (scores,
        masked, probabilities, their gradient, the scores' gradient: bench/long_context.py
        measured 5.1 GiB at sequence 16384, cp 4, 4 heads, where one is 1 GiB);
      cp_ring_attention (p2p, a2a+p2p): the block of keys and values held and the one
        arriving, their fp32 gradients held and arriving, and four pieces of a block's fp32
        scores of at most ``ring_attention.PIECE_BYTES`` each (its math path; the CPU's fused
        kernel holds less).
    The all-to-all's whole-sequence SDPA is a fused kernel: its own working set is O(rows)."""
    from fxmeg.runtime.ring_attention import PIECE_BYTES

    if node.target not in (ops.fx_ops.cp_attention.default, ops.fx_ops.cp_ring_attention.default):
        return 0
    q, k, v = (val(a) for a in node.args[:3])
    kv = k.numel() * k.element_size() + v.numel() * v.element_size()
    if node.target == ops.fx_ops.cp_attention.default:
        size = node.args[5]
        return 5 * 4 * q.shape[:-1].numel() * k.shape[-2] * size + kv * size
    scores = 4 * q.shape[:-1].numel() * k.shape[-2]
    return 4 * min(scores, PIECE_BYTES) + 2 * kv + 8 * (k.numel() + v.numel())


def region_bytes(gm: fx.GraphModule, node: fx.Node) -> int:
    """The own saved tensors of recompute region ``node`` of ``gm``: what backward holds
    while it runs that region again."""
    return sum(s.nbytes for s in _region_saved(gm, node))


def activation_bytes(gm: fx.GraphModule) -> int:
    """Bytes one micro-batch of chunk ``gm`` keeps for backward (``saved_tensors``)."""
    return sum(s.nbytes for s in saved_tensors(gm))


def breakdown(gm: fx.GraphModule) -> tuple[int, dict[str, int]]:
    """(blocks in the chunk, {where: bytes}): a block's tensors under their module
    within the block ('mlp.down_proj: input'), summed over the chunk's blocks (divide by
    the count for one layer); the rest under their full module name."""
    blocks = set(find_blocks(gm).values())
    out: dict[str, int] = defaultdict(int)
    for s in saved_tensors(gm):
        block = next((b for b in blocks if s.module == b or s.module.startswith(b + ".")), None)
        inner = s.module[len(block) + 1:] or "(block)" if block else None
        where = f"layer: {inner}" if block else (s.module or "(top level)")
        out[f"{where}: {s.what}"] += s.nbytes
    return len(blocks), dict(out)


def _region_saved(gm: fx.GraphModule, node: fx.Node) -> list[Saved]:
    region = attr(gm, node.target).region
    grads = requires_grad_nodes(gm)
    places = [p for p in region.graph.nodes if p.op == "placeholder"]
    seeds = {p for p, a in zip(places, node.args) if isinstance(a, fx.Node) and a in grads}
    seen: dict[object, Saved] = {}
    _walk(region, _grad_flow(region, seeds), dict(zip(places, node.args)), seen, skip=set(places))
    return list(seen.values())


def _walk(
    gm: fx.GraphModule,
    grads: set[fx.Node],
    alias: dict,
    seen: dict,
    skip: frozenset | set = frozenset(),
):
    """Add to ``seen`` (root -> Saved) what each node of ``gm`` keeps; ``alias`` maps a
    body's placeholders to the operands of the call, ``skip`` roots counted elsewhere."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and hasattr(attr(gm, node.target), "region"):
            if any(a in grads for a in node.all_input_nodes):  # a checkpoint keeps its inputs
                for a in node.all_input_nodes:
                    _keep(a, node, "recompute input", alias, seen, skip)
            continue
        if node.op != "call_function" or node not in grads:
            continue
        call = body_call(node) if is_hop(node) else None
        if call is not None:
            body, operands = call
            places = [p for p in body.graph.nodes if p.op == "placeholder"]
            seeds = {p for p, a in zip(places, operands) if isinstance(a, fx.Node) and a in grads}
            _walk(body, _grad_flow(body, seeds), alias | dict(zip(places, operands)), seen, skip)
            continue
        for kept, what in _kept(node, grads):
            if isinstance(kept, fx.Node):
                _keep(kept, node, what, alias, seen, skip)
            else:  # bytes of a tensor the op makes and keeps but returns not (log-sum-exp)
                seen.setdefault((node, what), Saved(owning_module(node), what, kept))


def _keep(kept, by: fx.Node, what: str, alias: dict, seen: dict, skip) -> None:
    root = view_root(kept, alias)
    v = val(root) if isinstance(root, fx.Node) else None
    if root in skip or not isinstance(v, torch.Tensor) or root.op == "get_attr" or root in seen:
        return
    seen[root] = Saved(owning_module(by), what, v.numel() * v.element_size())


def view_root(node, alias: dict | None = None):
    """The value ``node`` aliases: through views and a body's placeholders (``alias``)."""
    alias = alias or {}
    while isinstance(node, fx.Node):
        if node in alias:
            node = alias[node]
        elif node.target is operator.getitem:  # a split's piece is a view; a tuple's part is itself
            source = node.args[0]
            if source.op != "call_function" or is_hop(source) or not _is_view(source):
                break
            node = source.all_input_nodes[0]
        elif node.op == "call_function" and not is_hop(node) and node.all_input_nodes and (
                _is_view(node) or _attention_layout(node)):
            node = node.all_input_nodes[0]
        else:
            break
    return node


_RELAYOUTS = (
    aten.reshape.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.contiguous.default,
)


def _attention_layout(node: fx.Node) -> bool:
    """A reshape of fused attention's output transposed back to (b, s, heads, d): the
    kernels (flash on GPU and CPU) lay their output out that way, so it is a view, though
    the traced (meta) strides say copy."""
    if node.target not in _RELAYOUTS:
        return False
    source = node.all_input_nodes[0]
    while source.op == "call_function" and not is_hop(source) and source.all_input_nodes and (
            _is_view(source) or source.target in _RELAYOUTS):
        if source.target == aten.scaled_dot_product_attention.default:
            break
        source = source.all_input_nodes[0]
    return source.target == aten.scaled_dot_product_attention.default


def _kept(node: fx.Node, grads: set[fx.Node]) -> list[tuple[fx.Node | int, str]]:
    """(tensor or byte count, what it is) of what ``node``'s backward reads."""
    target, args = node.target, node.args
    name = getattr(getattr(target, "overloadpacket", None), "__name__", getattr(target, "__name__",
                                                                                ""))
    tensors = [a for a in args if isinstance(a, fx.Node)]
    if target is operator.getitem or name in _SAVE_NOTHING:
        return []
    if name in ("linear", "early_linear"):
        return [(args[0], "input")] if args[1] in grads else []
    if name in ("mm", "bmm", "matmul", "addmm") or (name in ("mul", "div") and len(tensors) == 2):
        a, b = args[1:3] if name == "addmm" else args[:2]
        kept = [(b, "factor")] if a in grads else []  # d/da reads b; d/db reads a
        return kept + ([(a, "input")] if b in grads else [])
    if name in ("mul", "div"):  # by a scalar
        return []
    if name == "tp_max":
        return [(args[0], "input"), (node, "output")]
    if name in _SAVE_INPUT:
        return [(args[0], "input")]
    if name in _SAVE_RESULT:
        return [(node, "output")]
    if name == "scaled_dot_product_attention":
        q = val(args[0])
        lse = q.shape[:-1].numel() * 4  # fp32 per query row and head
        mask = [(args[3], "attention mask")] if len(args) > 3 and isinstance(args[3],
                                                                             fx.Node) else []
        return [(args[0], "attention q"), (args[1], "attention k"), (args[2], "attention v"),
                (node, "attention output"), (lse, "attention log-sum-exp"), *mask]
    if name == "cp_attention":
        return [(args[0], "attention q"), (args[1], "attention k"), (args[2], "attention v")]
    if name == "cp_ring_attention":  # its own blocks of k and v; the output and lse
        out, lse = node.meta["val"]
        mask = [(args[3], "attention mask")] if isinstance(args[3], fx.Node) else []
        return [(args[0], "attention q"), (args[1], "attention k"), (args[2], "attention v"),
                (out.numel() * out.element_size(), "attention output"),
                (lse.numel() * 4, "attention log-sum-exp"), *mask]
    if name in ("embedding", "index_select", "gather", "index", "masked_fill", "where"):
        index = {"embedding": 1, "index_select": 2, "gather": 2, "index": 1, "masked_fill": 1,
                 "where": 0}[name]
        kept = args[index] if name != "index" else [a for a in args[1] if isinstance(a, fx.Node)]
        return [(k, "index / mask") for k in (kept if isinstance(kept, list) else [kept])]
    if name in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"):
        x = val(args[0])
        return [(args[0], "input"), (x.shape[:-1].numel() * 8, "norm statistics")]
    if name in ("dropout", "native_dropout") and args[1] > 0:
        return [(val(args[0]).numel(), "dropout mask")]
    if name == "cross_entropy_loss":  # log_softmax keeps its result, nll_loss the target
        logits = val(args[0])
        # + nll's total weight
        return [(logits.numel() * logits.element_size() + 4, "log-softmax of the logits"),
                (args[1], "index / mask")]
    if name == "vocab_parallel_cross_entropy":
        softmax, local = node.meta["val"][1:3]
        return [(softmax.numel() * 4 + local.numel() * local.element_size(),
                 "softmax of the logits"),
                (args[1], "index / mask")]
    if target is ops.routed_experts:

        return [(node, "output"), (routed_experts_bytes(node), "routed experts' rows")]
    return [(node, f"output ({name} not in the table)")]


def by_block(gm: fx.GraphModule) -> tuple[dict[str, int], int, int]:
    """({block: its saved bytes}, saved bytes outside blocks, bytes entering the blocks):
    what full recompute would keep is the last two (a block keeps its inputs)."""
    block_of = find_blocks(gm)
    blocks = set(block_of.values())
    inside: dict[str, int] = defaultdict(int)
    outside = 0
    for s in saved_tensors(gm):
        block = next((b for b in blocks if s.module == b or s.module.startswith(b + ".")), None)
        if block is None:
            outside += s.nbytes
        else:
            inside[block] += s.nbytes
    entering: dict[tuple[fx.Node, str], int] = {}
    for node, block in block_of.items():
        for a in node.all_input_nodes:
            v = val(a)
            if block_of.get(a) != block and a.op != "get_attr" and isinstance(v, torch.Tensor):
                entering[(a, block)] = v.numel() * v.element_size()
    return dict(inside), outside, sum(entering.values())


def routed_experts_bytes(node: fx.Node) -> int:
    """What one ``routed_experts`` node keeps for backward besides its output, with the
    routing balanced (a rank computes as many (token, slot) rows as it routes: T * k): the
    gathered rows, the first matmul's output, the activation's values (the middle
    sub-graph's nodes) and the second matmul's weighted output."""
    middle, hidden, index = (
        attr(node.graph.owning_module, node.args[0].target),
        val(node.args[1]),
        val(node.args[2]),
    )
    rows = index.numel()
    inner = [val(n) for n in middle.graph.nodes if n.op in ("placeholder", "call_function")]
    size = hidden.element_size()
    return (
        3 * rows * hidden.shape[-1]
        + sum(v.numel() for v in inner if v is not None and v.is_floating_point())
    ) * size
