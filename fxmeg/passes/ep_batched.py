"""Batched experts, read from the graph for the expert-parallel pass
(fxmeg/passes/expert_parallel.py): the form of Llama 4's ``Llama4TextExperts``, where every
expert runs over every token and the routing zeroes what it does not pick.

The form (no class or module name is read), with T tokens, E experts, top-k routing:

    rows    = hidden.repeat(E, 1) * scores.T.reshape(-1, 1)    # [E * T, H]: expert e's slot,
                                                               # every token scaled by its score
    up      = bmm(rows.view(E, T, H), w_up [E, H, N])          # the first bank
    out     = bmm(middle(up), w_down [E, I, H])                # the model's activation between
    result  = out.view(E, T, H).sum(0)                         # [T, H]: summed over the experts

where ``scores [T, E]`` is a chain of one-operand elementwise ops (casts, Llama 4's sigmoid)
of ``scatter(full_like(logits, fill), 1, top_k_index, values)`` and that chain maps
``fill`` to exactly 0 (sigmoid(-inf) = 0): outside a token's top-k experts its rows are
zero. When the experts map a zero row to zero (no bias bank; ``middle(0) = 0``, checked
on one row) the result is the routed computation of ``fxmeg.ir.moe`` with the routing
weights applied to each expert's input (Megatron's ``moe_apply_probs_on_input``): each
(token, slot) pair's row ``w * hidden[t]`` through its expert, the k results summed
unweighted. Only the grouping of the rows differs, and the sum over the k picked experts
instead of all E (the others add exact zeros).

``batched_experts`` returns None for a ``bmm`` that is not the first matmul of this form
(its first operand not a product with the tokens repeated once per expert); past that
point, a piece it cannot read raises PassError naming it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from fxmeg.errors import PassError
from fxmeg.frontend.capture import owning_module
from fxmeg.ir import ops
from fxmeg.passes.graph_utils import attr, users_reached, val
from fxmeg.passes.op_rules import in_family

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.to.dtype,
          aten._to_copy.default, aten.to.dtype_layout, aten.contiguous.default, aten.clone.default}
_BANK_VIEWS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.transpose.int,
               aten.permute.default, aten.t.default}
_SCATTERS = {aten.scatter.src, aten.scatter_.src, aten.scatter.value, aten.scatter_.value}
_FULLS = {aten.full_like.default, aten.full.default}  # their fill value: argument 1
_FIX = ". Fix: train this model with ep=1 (every rank computes every expert)"
_IDENTITY = {ops.fx_ops.tp_copy.default}
"""Ops whose forward is the identity: Megatron's f, which the tensor-parallel pass puts on
the scores of batched experts split over tp (fxmeg/passes/tp/experts.py)."""


@dataclass(frozen=True)
class BatchedExperts:
    """One block of the form (module docstring)."""

    up: fx.Node
    down: fx.Node
    hidden: fx.Node
    """The tokens [T, H]."""
    scores: fx.Node
    """The routing scores [T, E], zero outside each token's top-k."""
    top_k_index: fx.Node
    """[T, k]: the experts each token's scores are nonzero at."""
    result: fx.Node
    """[T, H]: the sum over the experts."""
    experts: int


def batched_experts(gm: fx.GraphModule, up: fx.Node) -> BatchedExperts | None:
    """The block whose first matmul is ``up`` (module docstring), or None."""
    if up.op != "call_function" or up.target is not aten.bmm.default:
        return None
    bank = _source(up.args[1], _BANK_VIEWS)
    if bank.op != "get_attr" or not isinstance(attr(gm, bank.target), torch.nn.Parameter):
        return None
    experts = val(bank).shape[0]
    weighted = _source(up.args[0], _VIEWS)
    repeat = next(
        (a for a in weighted.args if isinstance(a, fx.Node) and a.target is aten.repeat.default),
        None,
    )
    column = next((a for a in weighted.args if a is not repeat), None)
    if weighted.target is not aten.mul.Tensor or repeat is None or not isinstance(column, fx.Node):
        return None  # not rows of tokens scaled per row
    where = f"node {up.name!r}, module {owning_module(up)!r}"
    hidden = repeat.args[0]
    tokens = val(hidden).shape[0]
    if val(hidden).dim() != 2 or list(repeat.args[1]) != [experts, 1] or \
            tuple(val(up.args[0]).shape) != (experts, tokens, val(hidden).shape[1]):
        raise PassError(
            f"expert_parallel: the batched experts' rows ({where}) are not the {experts} experts' "
            f"slots [{experts}, tokens, hidden] of the tokens {list(val(hidden).shape)} repeated "
            "once per expert; fxmeg cannot tell which rows are which expert's" + _FIX
        )
    scores = _scores(column, tokens, experts, where)
    top_k_index = _top_k_index(scores, where)
    down = _second_matmul(gm, up, experts, where)
    result = _result(down, (experts, tokens, val(hidden).shape[1]), where)
    return BatchedExperts(up, down, hidden, scores, top_k_index, result, experts)


def maps_zero_to_zero(middle: fx.GraphModule, features: int, out_features: int) -> bool:
    """Whether the activation ``middle`` (the nodes between the matmuls) runs on one row
    of ``features`` and maps a zero row to a zero row of ``out_features``: the experts a
    token's routing skipped then add exact zeros, and the block may run its picked
    experts alone."""
    try:
        out = middle(torch.zeros(1, features))
    except Exception:  # noqa: BLE001 (a shape written for [E, T, N] values: not per row)
        return False
    return tuple(out.shape) == (1, out_features) and not out.any()


def _source(node: fx.Node, through: set) -> fx.Node:
    while node.op == "call_function" and node.target in through:
        node = node.args[0]
    return node


def _scores(column: fx.Node, tokens: int, experts: int, where: str) -> fx.Node:
    """The [T, E] scores whose transpose, flattened, is ``column`` [E * T, 1]."""
    flipped = _source(column, _VIEWS)
    ok = tuple(val(column).shape) == (experts * tokens, 1) and (
        flipped.target in (aten.t.default, aten.transpose.int) or
        (flipped.target is aten.permute.default and list(flipped.args[1]) == [1, 0]))
    if not ok or tuple(val(flipped.args[0]).shape) != (tokens, experts):
        raise PassError(
            f"expert_parallel: the batched experts' rows ({where}) are scaled by {column.name!r}, "
            f"which is not the routing scores [{tokens}, {experts}] transposed and flattened "
            "(expert-major, as the rows are)" + _FIX
        )
    return flipped.args[0]


def _top_k_index(scores: fx.Node, where: str) -> fx.Node:
    """The top-k index outside which ``scores`` are exactly zero (module docstring)."""
    chain, n = [], scores
    while n.op == "call_function" and n.target not in _SCATTERS and len(n.all_input_nodes) == 1 \
            and (in_family(n.target, "copy", "pointwise") or n.target in _IDENTITY):
        chain.append(n)
        n = n.all_input_nodes[0]
    fail = (
        f"expert_parallel: fxmeg cannot show that the routing scores {scores.name!r} ({where}) are "
        "zero outside each token's top-k experts (a chain of elementwise ops of "
        "scatter(full(fill), 1, top-k index, values) that maps fill to 0), so it cannot run only "
        "the experts each token picked"
        + _FIX
    )
    if n.target not in _SCATTERS or n.args[1] % 2 != 1 or n.args[0].target not in _FULLS:
        raise PassError(fail)
    index = _source(n.args[2], _VIEWS)
    if (
        index.target is not operator.getitem
        or index.args[1] != 1
        or index.args[0].target is not aten.topk.default
    ):
        raise PassError(fail)
    value = torch.tensor(float(n.args[0].args[1]))
    for c in reversed(chain):
        if in_family(c.target, "copy") or c.target in _IDENTITY:
            value = value.to(val(c).dtype)
        else:
            value = c.target(
                *[value if a is c.all_input_nodes[0] else a for a in c.args], **c.kwargs
            )
    if bool(value.any()):
        raise PassError(fail)
    return index


def _second_matmul(gm: fx.GraphModule, up: fx.Node, experts: int, where: str) -> fx.Node:
    """The one ``bmm`` after ``up`` over a bank of ``experts``."""
    downs = [u for u in users_reached(up, through=lambda u: u.target is not aten.bmm.default)
             if u.target is aten.bmm.default]
    banks = [_source(d.args[1], _BANK_VIEWS) for d in downs]
    if len(downs) != 1 or banks[0].op != "get_attr" or val(banks[0]).shape[0] != experts:
        raise PassError(
            f"expert_parallel: the batched experts' first matmul ({where}) is not followed by one "
            f"second matmul over a bank of {experts} experts (found {[d.name for d in downs]})"
            + _FIX
        )
    return downs[0]


def _result(down: fx.Node, shape: tuple[int, int, int], where: str) -> fx.Node:
    """The sum over the experts of ``down``'s [E, T, H] output (through views)."""
    n = down if tuple(val(down).shape) == shape else None
    while n is not None and len(n.users) == 1:
        n = next(iter(n.users))
        if n.target is aten.sum.dim_IntList and tuple(val(n.args[0]).shape) == shape and \
                [d % 3 for d in n.args[1]] == [0]:
            return n
        if n.target not in _VIEWS:
            break
    raise PassError(
        f"expert_parallel: the batched experts' output {down.name!r} ({where}) is not summed over "
        f"the experts (its [{shape[0]}, tokens, hidden] view, summed over dim 0)" + _FIX
    )
