"""Attention under context parallelism, the rules of the cp pass
(fxmeg/passes/context_parallel.py) for SDPA and for eager attention's two products: this
rank's queries attend to every key, either through ``fxmeg::cp_attention`` (causal) or
through all-gathered keys and values with the mask's rows cut to the local queries. ``self``
is the pass (``_ContextParallel``), as for its other rules."""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from fxmeg.ir.layouts import Seq
from fxmeg.ir.ops import CP
from fxmeg.ir.tags import set_tags, tags
from fxmeg.passes.cp.masks import is_causal_mask
from fxmeg.passes.graph_utils import call, full_args, val
from fxmeg.passes.op_rules import rule

aten = torch.ops.aten
fx_ops = torch.ops.fxmeg


def attention_product(self, node: fx.Node) -> Seq:
    """Eager attention (Hugging Face's eager path, ``q @ k^T ... softmax ... @ v``):
    the scores of this rank's queries against all-gathered keys (``fxmeg::cp_gather``
    of k^T along its last dim: global order), whose keys dim is ``full``; then the
    probabilities against all-gathered values. A mask added to the scores is a
    replicated (positions x positions) operand: its rows are cut to this rank's
    queries, its columns stay whole, so any mask the model builds from positions
    is exact. The full K and V are kept for backward (cp_attention keeps less)."""
    if self.parallel.cp_comm_type != "all_gather":
        raise self.refuse(
            node,
            f"it is eager attention (q @ k^T, softmax, @ v), which only cp_comm_type="
            f"'all_gather' exchanges; cp_comm_type={self.parallel.cp_comm_type!r} needs one "
            "fused attention (SDPA)",
            fix="build the model with attn_implementation='sdpa' (Hugging Face), call "
            "F.scaled_dot_product_attention, or use cp_comm_type='all_gather'",
        )
    a, b = node.args[:2]
    sa, sb = self.place[a], self.place[b]
    na, nb = val(a).dim(), val(b).dim()
    if sa.merged or sb.merged or sa.dim != na - 2:
        raise self.mixes(
            node, "it multiplies two values along the sequence other than as attention"
        )
    if sa.full is None and sb.full is None and sb.dim == nb - 1:  # scores = q @ k^T
        gathered, out = (b, nb - 1), Seq(val(node).dim() - 2, full=val(node).dim() - 1)
    elif sa.full == na - 1 and sb.full is None and sb.dim == nb - 2:  # out = probs @ v
        gathered, out = (b, nb - 2), Seq(val(node).dim() - 2)
    else:
        raise self.mixes(
            node,
            "it multiplies two values along the sequence other than as attention "
            "(q @ k^T, then probabilities @ v)",
        )
    full = self.move(gathered[0], "seq", "replicated", dim=gathered[1], at=node)
    node.replace_input_with(b, full)
    return out


@rule(CP, "attention")
def _attention(self, node: fx.Node) -> Seq:
    """Causal SDPA (is_causal, or a mask recognised as the causal one) becomes
    ``fxmeg::cp_attention``. Under another mask that depends on no split input (a
    sliding window built from positions, a padding mask from an input kept whole) it
    stays SDPA, of this rank's queries against all-gathered keys and values, with the
    mask's rows cut to those queries (exact for any such mask; the full K and V are
    kept for backward); so does an attention with neither mask nor is_causal (an
    encoder's: every query sees every key). A mask that depends on a split input is
    refused."""
    q, k, v, mask, dropout, causal, scale, gqa = full_args(node)
    if (
        mask is not None
        and not causal
        and is_causal_mask(mask, self.gm, val(q).shape[-2], val(k).shape[-2])
    ):
        # Hugging Face's sdpa path: the causal mask built from positions
        mask, causal = None, True
    if mask is not None and not _sliceable_mask(self, mask):
        split = isinstance(self.place.get(mask), (Seq, list))
        raise self.refuse(
            node,
            self.masks.unsliceable(mask, split, self.seq),
            fix=(
                "pass the padding mask as an input of its own that feeds attention masks alone "
                "(Hugging Face's attention_mask): every cp rank reads it whole; or cp=1"
                if split
                else f"give the mask the shape (..., 1 or {self.seq}, {self.seq}), or cp=1"
            ),
        )
    if dropout:
        raise self.refuse(node, f"it is an attention with dropout_p={dropout}",
                           fix="set the attention dropout to 0, or cp=1")
    seqs = {self.place.get(a) for a in (q, k, v)}
    dim = val(q).dim() - 2  # a Seq with ``full`` (scores) never equals Seq(dim)
    if seqs != {Seq(dim)}:
        raise self.refuse(
            node,
            f"its q, k and v are not all split along the sequence dim {dim} "
            f"(places {sorted(map(str, seqs))})",
        )
    if self.parallel.cp_comm_type != "all_gather":
        return _exchanged(self, node, (q, k, v, mask, causal, scale, gqa), dim)
    if mask is not None or not causal:
        keys = self.move(k, "seq", "replicated", dim=dim, at=node)
        values = self.move(v, "seq", "replicated", dim=dim, at=node)
        rows = mask.meta["val"].dim() - 2 if mask is not None else None
        if rows is not None and val(mask).shape[rows] != 1:
            mask = self._cut(mask, rows, node)
        node.args = (q, keys, values, mask, 0.0, False)
        node.kwargs = {"scale": scale, "enable_gqa": gqa}
        return Seq(dim)
    with self.g.inserting_before(node):
        core = call(
            self.g, fx_ops.cp_attention.default, (q, k, v, scale, gqa, self.cp, CP), like=node
        )
    node.replace_all_uses_with(core)
    self.g.erase_node(node)
    self.place[core] = Seq(dim)
    return Seq(dim)

def _exchanged(self, node: fx.Node, args: tuple, dim: int) -> Seq:
    """The attention under cp_comm_type p2p, a2a or a2a+p2p (docs/long-context.md):
    ``cp_to_heads`` of q, k and v over runs of ``inner`` cp ranks (a2a: all of them), then
    SDPA over the whole sequence (a2a) or ``cp_ring_attention`` over the runs (p2p: runs
    of one), then ``cp_from_heads``. The mask, if any, is passed whole."""
    q, k, v, mask, causal, scale, gqa = args
    inner, size = self.parallel.cp_inner, self.cp
    if inner > 1:
        _check_heads(self, node, val(q).shape[dim - 1], val(k).shape[dim - 1])
    g, whole = self.g, val(node)

    def add(target, args, kwargs=None, value=whole):
        # the values are refreshed on local shapes when the propagation ends
        new = g.create_node("call_function", target, args, kwargs or {})
        set_tags(new, tags(node))
        new.meta["val"] = value
        return new

    with g.inserting_before(node):
        if inner > 1:
            q, k, v = (add(fx_ops.cp_to_heads.default, (t, dim, size, inner, CP), value=val(t))
                       for t in (q, k, v))
        if inner == size:
            out = add(aten.scaled_dot_product_attention.default, (q, k, v, mask, 0.0, causal),
                      {"scale": scale, "enable_gqa": gqa})
        else:
            lse = whole.new_empty(whole.shape[:-1], dtype=torch.float32)
            ring = add(fx_ops.cp_ring_attention.default,
                       (q, k, v, mask, causal, scale, gqa, size, inner, CP), value=(whole, lse))
            out = add(operator.getitem, (ring, 0))
        if inner > 1:
            out = add(fx_ops.cp_from_heads.default, (out, dim, size, inner, CP))
    node.replace_all_uses_with(out)
    g.erase_node(node)
    self.place[out] = Seq(dim)
    return Seq(dim)


def _check_heads(self, node: fx.Node, heads: int, kv_heads: int) -> None:
    """All-to-all splits every tp rank's query and key/value heads over ``inner`` cp ranks."""
    inner, tp, mode = self.parallel.cp_inner, self.parallel.tp, self.parallel.cp_comm_type
    if heads % (tp * inner) == 0 and kv_heads % (tp * inner) == 0:
        return
    common = math.gcd(heads, kv_heads)
    per = common // tp if common % tp == 0 else 0
    fits = [d for d in range(2, per + 1) if per % d == 0 and self.cp % d == 0]
    size = "cp" if mode == "a2a" else "cp_a2a_size"
    on = f" on each of tp={tp} ranks" if tp > 1 else ""
    other = (f"a {size} in {fits}" + (" (cp_comm_type='a2a+p2p' with that cp_a2a_size)"
                                      if mode == "a2a" else "")) if fits else None
    raise self.refuse(
        node,
        f"cp_comm_type={mode!r} splits its {heads} query and {kv_heads} key/value heads{on} "
        f"over {size}={inner} ranks, which does not divide them",
        fix="use cp_comm_type='p2p' (no head split)" + (f", or {other}" if other else ""),
    )


def _sliceable_mask(self, mask: fx.Node) -> bool:
    """A mask that depends on no split input, (..., 1 or s, 1 or s): its rows can be
    cut to this rank's queries."""
    v = val(mask)
    return (self.place.get(mask) is None and v is not None and v.dim() >= 2
            and v.shape[-2] in (1, self.seq) and v.shape[-1] in (1, self.seq))
