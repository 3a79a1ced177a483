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
import re

import torch
from torch import fx

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
