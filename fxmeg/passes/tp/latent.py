"""Down projections shared by every head stay whole under tensor parallelism, found by
structure (``_TensorParallel._role`` asks ``shared_by_heads``).

DeepSeek's latent attention (MLA) projects the hidden state down to small latents shared
by every head, then up to per-head queries, keys and values:

    q  = q_b_proj(rms_norm(q_a_proj(x)))                 (..., heads * qk_head_dim)
    c  = kv_a_proj_with_mqa(x)                           (..., kv_lora_rank + rope_dim)
    kv = kv_b_proj(rms_norm(c[..., :kv_lora_rank]))      (..., heads * (nope + v))
    k_rot = rope(c[..., kv_lora_rank:])                  one rotary key for every head

Megatron's MLA at tp keeps the down projections and their norms whole (their outputs are
small and every head reads them), splits the up projections by columns over heads and
o_proj by rows. Split by columns instead, a down projection would make the up
projection row-parallel, its output whole: every rank would compute every head, and the
shared rotary key would be cut in pieces no head can use.

The rule, by what the output feeds: a linear whose output (or a piece of it) reaches the
input of another linear through ops per token that read nothing else but parameters (a
cast, a norm, a split or slice of its features, a view), where that second linear's
output is unpacked into heads, is such a down projection: it stays whole. An MLP's up
projection feeds its down projection too, but the down projection's output is the
block's output, never unpacked into heads; the residual stream never joins the walk (an
add of another value stops it).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxmeg.passes.graph_utils import val
from fxmeg.passes.op_rules import LINEAR_SLOTS, in_family
from fxmeg.passes.tp.heads import head_view

_PER_TOKEN = ("copy", "pointwise", "view", "split", "slice", "reduction", "norm")
"""Families the walk passes through: each keeps the tokens apart (a reduction only along
the features, as a norm's mean of squares)."""


def shared_by_heads(linear: fx.Node) -> bool:
    """Whether ``linear`` is a down projection whose output feeds a per-head up projection
    (the module docstring)."""
    reached = {linear}
    todo = [linear]
    while todo:
        for user in todo.pop().users:
            if user in reached or user.op != "call_function":
                continue
            if not all(a in reached or a.op == "get_attr" for a in user.all_input_nodes):
                continue  # it reads another value too (the residual stream, the rotary angles)
            slots = LINEAR_SLOTS.get(user.target)
            if slots is not None and user.args[slots.x] in reached:
                if isinstance(out := val(user), torch.Tensor) and head_view(user, out.shape[-1]):
                    return True
                continue
            if user.target is operator.getitem or _per_token(user):
                reached.add(user)
                todo.append(user)
    return False


def _per_token(node: fx.Node) -> bool:
    """An op of the walk: per token, and a reduction only along the last dim."""
    if not in_family(node.target, *_PER_TOKEN):
        return False
    if not in_family(node.target, "reduction"):
        return True
    x, out = val(node.args[0]), val(node)
    if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    # (..., F) -> (..., 1) or (...): the leading dims, the tokens, untouched
    return tuple(out.shape[: x.dim() - 1]) == tuple(x.shape[:-1])
