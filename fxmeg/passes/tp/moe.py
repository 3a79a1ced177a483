"""Mixture-of-experts blocks under tensor parallelism: which linears of a block stay whole
(a router, a one-feature gate) and what the tensor-parallel pass says about the expert
weights it leaves whole (fxmeg/passes/tensor_parallel.py reads both).

A router is recognised by what its output feeds, not by its class or module name: a
linear whose output features are scored against one another, that is, reached through
ops that keep them as the last dim (casts, elementwise ops, reshapes that keep the last
dim's size) by a softmax or an ordering (topk, sort: the ``softmax`` and ``rank`` op
families) along that dim. Mixtral, Qwen2/3-MoE and OLMoE softmax the router's logits over
the experts, GPT-OSS takes their top-k first. Column-splitting such a linear splits the
very dim those ops compute along (every tp rank would rank only its own experts), so it
stays whole: every tp rank scores every expert for every token, the same values. A
linear with one output feature (a per-token scalar gate, as Qwen2-MoE's
``shared_expert_gate``) stays whole too: there is nothing to split.

The experts themselves (Hugging Face's fused 3-D ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``) are not linears: they read the replicated hidden state and the
replicated routing, so they stay whole and every tp rank computes every expert. That
repeats work, so it is never silent: ``say_what_stays_whole`` logs it for the pass.
"""

from __future__ import annotations

import logging
import math
import re

import torch
from torch import fx

from fxmeg.ir.layouts import Shard
from fxmeg.passes.graph_utils import users_reached, val
from fxmeg.passes.op_rules import dim_argument, in_family

log = logging.getLogger("fxmeg.passes.tensor_parallel")


def scores_features(linear: fx.Node) -> bool:
    """Whether ``linear``'s output is a router's scores (softmaxed or ranked along its
    features) or a single feature: the two kinds of linear that stay whole under tp."""
    out = val(linear)
    if out is None:
        return False
    size = out.shape[-1]
    if size == 1:
        return True
    for user in users_reached(linear, through=lambda u: _keeps_features(u, size)):
        if in_family(user.target, "softmax", "rank"):
            dims = val(user.args[0]).dim()
            if dim_argument(user, -1) % dims == dims - 1:
                return True
    return False


def _keeps_features(node: fx.Node, size: int) -> bool:
    """``node`` keeps the scores' features as its last dim: a cast, an elementwise op, a
    reshape that keeps the last dim (tokens flattened, as routers do)."""
    out = val(node)
    if out is None or out.dim() == 0 or out.shape[-1] != size:
        return False
    return in_family(node.target, "copy", "pointwise", "view")


def layer_glob(module: str) -> str:
    """``module`` with its layer numbers as ``*``: 'model.layers.*.mlp.gate'."""
    return re.sub(r"\.\d+\.", ".*.", module + ".").rstrip(".")


def whole_experts(params: dict[str, torch.Tensor], tp: int, ep: int = 1) -> str | None:
    """The warning for the expert modules tensor parallelism leaves whole (``params``:
    name -> full tensor, the replicated ones), or None when there are none. An expert
    module holds a parameter of three or more dims (a bank of experts); all its
    parameters (GPT-OSS's expert biases too) are listed, by module globbed over layers,
    with their shapes and the total."""
    owners = {n.rpartition(".")[0] for n, t in params.items() if t.dim() >= 3}
    banks = {n: t for n, t in params.items() if n.rpartition(".")[0] in owners}
    if not banks:
        return None
    modules: dict[str, set[str]] = {}
    for name, t in banks.items():
        module, _, leaf = name.rpartition(".")
        modules.setdefault(layer_glob(module), set()).add(f"{leaf} {list(t.shape)}")
    listed = "; ".join(f"{m!r} ({', '.join(sorted(v))})" for m, v in sorted(modules.items()))
    total = sum(t.numel() for t in banks.values())
    if ep > 1:
        return (
            f"tp={tp} leaves {len(banks)} expert parameters ({total} elements before ep={ep} "
            f"splits them) whole over tp ranks: {listed}. Every tp rank holds and computes the "
            "same experts of its ep rank; tensor parallelism splits the attention and dense "
            "projections only"
        )
    return (f"tp={tp} leaves {len(banks)} expert parameters ({total} elements) whole on every tp "
            f"rank: {listed}. Every tp rank holds and computes every expert (the same values); "
            "tensor parallelism splits the attention and dense projections only")


def say_what_stays_whole(
    tp: int, routers: list[str], whole: dict[str, torch.Tensor], *, ep: int = 1
) -> None:
    """Redundancy under tp is never silent. On the logger ``fxmeg.passes.tensor_parallel``:
    the modules of the linears kept whole by kind (``routers``, INFO) and the expert
    modules among the parameters left whole (``whole``: name -> full tensor, WARNING)."""
    if routers:
        globs = ", ".join(sorted({layer_glob(m) for m in routers}))
        log.info(
            "tp=%d keeps %d router linears whole (softmaxed or ranked over their output features, "
            "or a single feature): %s",
            tp,
            len(routers),
            globs,
        )
    warning = whole_experts(whole, tp, ep)
    if warning:  # with ep the experts are split, over ep: said, not warned
        (log.info if ep > 1 else log.warning)(warning)


# ---------------------------------------------------------------- sequence parallelism


def flattens_tokens(s: Shard, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """A reshape from ``a`` to ``b`` that merges sequence-split dim ``s.dim`` with the dims
    before it into one dim of tokens, keeping the dims after it: a block of routed experts
    flattening (batch, seq, hidden) into (tokens, hidden) to route each token."""
    if not s.seq or s.dim == 0:
        return False
    merged = math.prod(a[: s.dim + 1])
    return len(b) >= 1 and b[0] == merged and tuple(b[1:]) == tuple(a[s.dim + 1 :])


def whole_tokens(tpass, node: fx.Node, s: Shard) -> None:
    """Under sequence parallelism, the tokens a block flattens to route them
    (``flattens_tokens``) are gathered whole first (``sp_whole``), once per value: every tp
    rank routes every token and runs the experts as without sp, each split over tp under
    expert tensor parallelism (fxmeg/passes/tp/experts.py: the block's sum all-reduced over
    tp, then cut back to this rank's part) or whole (Megatron gathers the sequence before
    its MoE token dispatcher too). Exact without more: every
    routing decision and the router loss see all tokens, the same on every rank, so each
    rank holds the whole gradient of the block's values (the router loss's included);
    where the block's output rejoins the sequence split, ``sp_split`` keeps this rank's
    part and gathers the gradient back whole (``from_whole``)."""
    x = node.args[0]
    if x not in tpass.whole_entries:
        full = tpass.move(x, "seq", "whole", dim=s.dim, at=node)
        tpass.place[full] = None
        tpass.whole_entries[x] = full
    node.replace_input_with(x, tpass.whole_entries[x])


def from_whole(tpass, node: fx.Node) -> bool:
    """Whether ``node`` is computed from tokens gathered whole (``whole_tokens``): where it
    meets the sequence split it is cut with ``sp_split``, and a row-parallel linear in it
    (a shared expert's down projection) is all-reduced, not scattered along a sequence it
    no longer has."""
    entries = set(tpass.whole_entries.values())
    if not entries:
        return False
    todo, seen = [node], {node}
    while todo:
        n = todo.pop()
        if n in entries:
            return True
        for a in n.all_input_nodes:  # not back into the sequence-split stream
            p = tpass.place.get(a)
            if a not in seen and not (isinstance(p, Shard) and p.seq):
                seen.add(a)
                todo.append(a)
    return False
