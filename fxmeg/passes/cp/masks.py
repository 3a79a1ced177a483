"""Which sequence inputs the context-parallel pass keeps whole (padding masks), the
value of a mask that depends on no input (``constant_value``), whether it is the causal
mask (``is_causal_mask``), and why a mask cannot be cut to a rank's queries.

A padding mask (Hugging Face's ``attention_mask``, (batch, seq): 1 for real tokens, 0 for
pads) is an input along the sequence, but attention reads it along the keys, and every
query attends to the keys of the whole sequence: a rank needs every position of it. So
an input that feeds attention masks and nothing else is not cut: every cp rank reads it
whole (its ``CPLayout`` dim is None), the values built from it are whole-sequence
(replicated) values, and the rows of the 4-D mask (batch, 1, queries, keys) are cut to
this rank's queries where it meets attention, as for a mask built from positions.

Found on the graph before any rewriting, from which split inputs each node depends on.
The region of input x is the nodes that depend on x and on no other sequence input; a
use leaving it (a node reading it that also depends on another input, or an output) is
a *mask use* when it is an SDPA reading it as ``attn_mask`` only, or an elementwise op
(eager attention: scores plus mask, ``masked_fill``, ``where``) of a (.., 1 or s, s) value
and (.., s, s) scores. The context-parallel pass checks the rest as it propagates: a
whole value meeting a split one is cut to this rank's positions or refused, and a whole
value returned as an output is refused (summed over cp ranks it would count cp times).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from fxmeg.passes.graph_utils import attr, full_args, is_hop, val
from fxmeg.passes.op_rules import in_family

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


@dataclass(frozen=True)
class MaskInputs:
    """``whole``: inputs kept whole (they feed attention masks alone); ``mixed``: input ->
    (a mask use, another use) for inputs that feed a mask and more (they stay split, and
    refusals inside their mask say so); ``deps``: node -> the sequence inputs it depends on."""

    whole: frozenset[fx.Node]
    mixed: dict[fx.Node, tuple[fx.Node, fx.Node]]
    deps: dict[fx.Node, frozenset[fx.Node]]

    def hint(self, node: fx.Node) -> str:
        """Why the one input ``node`` is computed from was split although it feeds a mask."""
        deps = self.deps.get(node, frozenset())
        x = next(iter(deps)) if len(deps) == 1 else None
        if x not in self.mixed:
            return ""
        mask, other = self.mixed[x]
        return (
            f" (input {x.name!r} feeds the attention mask at node {mask.name!r} but also node "
            f"{other.name!r}: only an input that feeds attention masks alone stays whole on every "
            "cp rank; this one is cut)"
        )

    def unsliceable(self, mask: fx.Node, split: bool, seq: int) -> str:
        """Why an attention's ``mask`` cannot have its rows cut to a cp rank's queries:
        it depends on inputs cut along the sequence (``split``), or it is not shaped
        (..., 1 or seq, 1 or seq)."""
        if split:
            inputs = sorted(x.name for x in self.deps.get(mask, ()) if x not in self.whole)
            return (
                "it is an attention with a mask that depends on the split inputs (padding): mask "
                f"{mask.name!r} is computed from input(s) {inputs}, which are cut along the "
                "sequence"
                + (self.hint(mask) or " (they are not used by attention masks alone)")
            )
        return (
            f"it is an attention whose mask {mask.name!r} {tuple(val(mask).shape)} is not (..., 1 "
            f"or {seq}, 1 or {seq}) (queries, keys): its rows cannot be cut to this rank's queries"
        )


def mask_inputs(graph: fx.Graph, inputs: list[fx.Node], seq: int) -> MaskInputs:
    """Classify the sequence ``inputs`` (dim 1 of length ``seq``) of ``graph`` (module docstring).
    """
    deps: dict[fx.Node, frozenset[fx.Node]] = {}
    for n in graph.nodes:  # graph order is a topological order
        mine = frozenset([n]) if n in inputs else frozenset()
        deps[n] = mine.union(*(deps[a] for a in n.all_input_nodes))
    whole, mixed = set(), {}
    for x in inputs:
        order = [n for n, d in deps.items() if d == {x}]  # graph order: messages name the first use
        region = set(order)
        masks, others = [], []
        for n in order:
            for u in n.users:
                if u not in region:
                    (masks if _mask_use(n, u, seq) else others).append(u)
        if masks and not others:
            whole.add(x)
        elif masks:
            mixed[x] = (masks[0], others[0])
    return MaskInputs(frozenset(whole), mixed, deps)


def _mask_use(n: fx.Node, u: fx.Node, seq: int) -> bool:
    """Whether ``u`` reads ``n`` as an attention mask (module docstring)."""
    if u.op != "call_function":
        return False
    if u.target == _SDPA:
        args = full_args(u)
        return args[3] is n and n not in args[:3]
    if not in_family(u.target, "pointwise"):
        return False
    v, out = val(n), val(u)
    return (
        v is not None
        and out is not None
        and v.dim() >= 2
        and out.dim() >= 2
        and v.shape[-1] == seq
        and v.shape[-2] in (1, seq)
        and tuple(out.shape[-2:]) == (seq, seq)
    )


_MAX_CONSTANT_NODES = 500


def constant_value(node: fx.Node, gm: fx.GraphModule) -> torch.Tensor | None:
    """The value of ``node`` computed now, if it depends on no input (placeholder), no
    random op and no meta tensor (a mask built from ``arange``); else None. A graph
    captured on meta (a model built on meta, a new input shape) creates its tensors with
    ``device=meta``: they are made on the CPU here, so that such a mask is recognised as
    on a real capture."""
    needed, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        if n.op == "placeholder" or is_hop(n) or len(needed) > _MAX_CONSTANT_NODES:
            return None
        if n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(
            n.target, "tags", ()
        ):
            return None
        needed.add(n)
        todo.extend(n.all_input_nodes)
    env: dict[fx.Node, object] = {}
    for n in gm.graph.nodes:  # graph order is a topological order
        if n not in needed:
            continue
        if n.op == "get_attr":
            env[n] = attr(gm, n.target)
            if isinstance(env[n], torch.Tensor) and env[n].is_meta:
                return None
        else:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            kwargs = {k: torch.device("cpu") if k == "device" and _is_meta_device(v) else v
                      for k, v in kwargs.items()}
            env[n] = n.target(*args, **kwargs)
    out = env[node]
    return out if isinstance(out, torch.Tensor) and not out.is_meta else None


def _is_meta_device(d) -> bool:
    return d is not None and torch.device(d).type == "meta"


def is_causal_mask(mask: fx.Node, gm: fx.GraphModule, queries: int, keys: int) -> bool:
    """Whether ``mask`` depends on no input and, computed now, is the causal mask of the
    whole sequence (True, or 0 in an additive mask, exactly where key <= query) for every
    batch and head: then attention under it is causal attention."""
    value = constant_value(mask, gm)
    if value is None or queries != keys or value.dim() < 2 or value.shape[-2:] != (queries, keys):
        return False
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=value.device).tril()
    if value.dtype == torch.bool:
        return bool((value == allowed).all())
    if not value.is_floating_point():
        return False
    blocked = value <= torch.finfo(value.dtype).min / 2
    return bool(((value == 0) == allowed).all() and (blocked == ~allowed).all())
