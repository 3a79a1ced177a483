"""Mixture-of-experts models under context parallelism (the context-parallel pass,
fxmeg/passes/context_parallel.py, calls these; tp_moe.py is the same for tensor
parallelism).

A router loss (Switch / Mixtral's load-balancing loss) is built from sums over tokens:
tokens per expert (a histogram of the top-k ids) and probability sums. On a cp rank those
are sums over its own tokens, a part (PARTIAL) of the sums over the whole sequence.
``partial`` carries parts through the steps linear in them and all-reduces the counts
where two parts meet in a product, so the router loss is the sum of every cp rank's part.
Routed-experts blocks (fxmeg/passes/expert_parallel.py) are per token: ``routed_experts``
makes their fixed token counts this rank's.
"""

from __future__ import annotations

import torch
from torch import fx

from fxmeg.ir.layouts import PARTIAL, Seq
from fxmeg.passes.expert_parallel import routed_blocks
from fxmeg.passes.graph_utils import divide_shape_arg, val
from fxmeg.passes.op_rules import in_family

aten = torch.ops.aten
fx_ops = torch.ops.fxmeg
SUMS = {aten.sum.default, aten.sum.dim_IntList}


def only_counted(node: fx.Node) -> bool:
    """Every use of ``node`` (through casts) counts its values into bins (histogram)."""
    users = list(node.users)
    return bool(users) and all(
        in_family(u.target, "histogram") or (in_family(u.target, "copy") and only_counted(u))
        for u in users
    )


def partial(cp_pass, node: fx.Node):
    """A value computed from sums over this rank's tokens (PARTIAL: the loss sum, a
    router loss's token counts and probability sums). Steps linear in the parts keep
    a part of the whole: a sum of parts (zeros besides), a scalar factor or divisor, a
    cast or view, a sum, a product with a value every rank holds whole, the loss with
    its auxiliary loss (``scale_aux_loss``: both parts; the runtime's weight is the
    same on every rank). In a product of two parts, one no gradient flows through (a
    router's tokens per expert) is all-reduced over cp first (``cp_all_reduce``):
    the router loss is then the sum over cp ranks of each rank's part, exactly the
    loss over the whole sequence. Anything else is refused."""
    t, places = node.target, [cp_pass.place.get(a) for a in node.all_input_nodes]
    parts = [a for a in node.all_input_nodes if cp_pass.place.get(a) is PARTIAL]
    if any(isinstance(p, (Seq, list)) for p in places):
        raise cp_pass.mixes(
            node, "it mixes a sum over this rank's part of the sequence with split values"
        )
    if t == fx_ops.scale_aux_loss.default and len(parts) == 2:
        return PARTIAL
    if t in (aten.add.Tensor, aten.add_.Tensor) and all(a in parts or a.target == aten.zeros.default
                                                         for a in node.all_input_nodes):
        if all(a is None or isinstance(a, fx.Node) for a in node.args[:2]):
            return PARTIAL
    if t in (aten.mul.Tensor, aten.div.Tensor):
        if len(parts) == 2 and t == aten.mul.Tensor:
            counts = next((a for a in parts if a not in cp_pass.grads), None)
            if counts is None:
                raise cp_pass.refuse(
                    node,
                    "it multiplies two sums over this rank's part of the sequence "
                    "that both need gradients",
                )
            whole = cp_pass.move(counts, "partial", "replicated", at=node, like=counts)
            node.replace_input_with(counts, whole)
            cp_pass.place[whole] = None
            return PARTIAL
        if parts == [node.args[0]] or (t == aten.mul.Tensor and len(parts) == 1):
            return PARTIAL
    if t in SUMS or in_family(t, "copy", "view"):
        return PARTIAL
    raise cp_pass.refuse(
        node,
        "it reads a sum over this rank's part of the sequence in a way that is not "
        "linear in it (only a loss and a router loss built from sums may be one)",
    )


def routed_experts(cp_pass) -> dict[fx.Node, fx.Node | None]:
    """Routed-experts blocks (fxmeg/passes/expert_parallel.py) are computed per token:
    each rank runs its own tokens through them as they are. Their nodes get no rule;
    a block's result holds the sequence where its tokens do; the sizes the graph fixed
    for all tokens (the view back to [tokens, k, hidden], the arange over the routed
    pairs) become this rank's. Returns node -> the node whose place it takes (the
    tokens for a block's result, None for the nodes inside it)."""
    out: dict[fx.Node, fx.Node | None] = {}
    for block in routed_blocks(cp_pass.gm, strict=False):  # one it cannot read meets the rules
        tokens, k = val(block.top_k_index).shape
        for n in block.inner():
            if n.target in (aten.view.default, aten.reshape.default) and val(n).shape[0] == tokens:
                divide_shape_arg(n, 0, cp_pass.cp)
            elif n.target == aten.arange.default and n.args[0] == tokens * k:
                n.args = (tokens * k // cp_pass.cp, *n.args[1:])
            out[n] = None
        out[block.result] = block.hidden
    return out
