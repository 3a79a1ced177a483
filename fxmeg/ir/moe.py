"""Routed experts, computed the way the expert-parallel pass rewrites them
(fxmeg/passes/expert_parallel.py; docs/parallelism.md, expert parallelism).

A routed-experts block maps tokens ``hidden [T, H]`` with their top-k experts
``top_k_index [T, k]`` and weights ``top_k_weights [T, k]`` to
``out[t] = sum_j w[t, j] * down_e(middle(up_e(hidden[t])))`` with ``e = index[t, j]``,
where ``up_e`` / ``down_e`` multiply by expert e's slice of a 3-D bank (plus its bias row
when the bank has biases) and ``middle`` is the model's own activation (SwiGLU,
GPT-OSS's clamped GLU ...), taken from its graph. With ``probs_on_input`` (Llama 4's
experts; Megatron's ``moe_apply_probs_on_input``) the weight scales the expert's input
instead: ``out[t] = sum_j down_e(middle(up_e(w[t, j] * hidden[t])))``.

``routed_experts`` computes it as Megatron's dropless token dispatcher does: sort the
(token, slot) pairs by expert, hand each expert's rows to the rank holding it
(``Exchange``: with none, every expert is local), run each local expert on its rows,
send the results back, weight them and sum each token's k results. The sums follow the
order Hugging Face's grouped experts use (rows back in (token, slot) order, then summed
over the slots), in the same dtypes (rows weighted by the routing weights in their
promoted dtype: fp32 with Mixtral's fp32 router under bf16), so the values are those of
the model's own forward.

With a capacity factor (``MoEConfig.moe_capacity_factor``; Megatron's
``--moe-expert-capacity-factor`` with drop policy "probs" and
``--moe-pad-expert-input-to-capacity``), each expert takes at most
``capacity = ceil(T * k / E * capacity_factor)`` of this rank's (token, slot) pairs: those
with the highest routing weights (``capacity_mask``); a dropped pair adds nothing to its
token (no renormalisation of the others). Every expert's rows are padded with zero rows
to exactly ``capacity``, so the rows exchanged and multiplied have static shapes
(``Exchange.dispatch_padded``); the pads' results are discarded. The pairs dropped are
counted per layer (``DropCounts``) and logged once per step (``DropCounts.log``).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, fx

from fxmeg.ir.recomputation import Recomputation

log = logging.getLogger(__name__)


class Exchange(Protocol):
    """Moves expert rows between the ranks that split the experts (the runtime's
    all-to-all; ``fxmeg.runtime.experts``)."""

    size: int
    """Ranks splitting the experts (ep)."""

    def dispatch(self, rows: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, object]:
        """``rows`` sorted by global expert with ``counts[E]`` rows per expert -> (this
        rank's rows grouped by its local experts, rows per local expert, what
        ``combine`` needs)."""

    def dispatch_padded(self, rows: Tensor, capacity: int) -> tuple[Tensor, object]:
        """``rows``: ``capacity`` rows for each global expert in turn (capacity mode) ->
        (this rank's rows grouped by its local experts, ``size * capacity`` each, what
        ``combine`` needs). Every split is known in advance: no counts are exchanged."""

    def combine(self, out: Tensor, state: object) -> Tensor:
        """``dispatch``'s inverse on the experts' results: rows back in the sender's order."""


def routed_experts(
    middle: fx.GraphModule,
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    b_up: Tensor | None = None,
    b_down: Tensor | None = None,
    *,
    num_experts: int,
    exchange: Exchange | None = None,
    capacity_factor: float | None = None,
    layer: str = "",
    probs_on_input: bool = False,
    drops: DropCounts | None = None,
    taps: list[Tensor] | None = None,
    down_sum: str | None = None,
) -> Tensor:
    """The routed experts' output ``[T, H]`` (module docstring). ``w_up [E_l, H, N]`` and
    ``w_down [E_l, I, H]`` (input dim before output dim) and the biases ``[E_l, N]`` hold
    this rank's ``E_l = num_experts / exchange.size`` experts (all of them without an
    exchange). With ``capacity_factor``: capacity mode (module docstring), its drops
    counted under ``layer`` in ``drops`` (None: not counted). With ``probs_on_input`` each
    pair's weight scales its row before the expert (``down_e(middle(up_e(w * hidden[t])))``, summed
    unweighted: Llama 4's experts; Megatron's ``moe_apply_probs_on_input``) instead of its result.
    ``taps``: a list to which ``expert_mlp`` appends the two expert matmuls' results (a
    zero-bubble split's weight-gradient pass starts there; fxmeg/ir/moe_split.py).
    ``down_sum``: the tensor-parallel group (its name) over which each expert is split
    (expert tensor parallelism) and whose ranks' second matmuls give partial sums: summed
    over it right after that matmul (Megatron's g), before the down bias, which is added once
    (GPT-OSS's experts; without a down bias the sum goes after the block: passes/tp/experts.py).
    """
    if capacity_factor is not None:
        return _with_capacity(
            middle,
            hidden,
            top_k_index,
            top_k_weights,
            (w_up, w_down, b_up, b_down),
            num_experts=num_experts,
            exchange=exchange,
            capacity_factor=capacity_factor,
            layer=layer,
            probs_on_input=probs_on_input,
            drops=drops,
            taps=taps,
            down_sum=down_sum,
        )
    tokens, k = top_k_index.shape
    ids, perm = torch.sort(top_k_index.reshape(-1))
    rows = hidden[perm // k]
    weights = top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    if probs_on_input:  # in the promoted dtype, as Llama 4's repeated tokens times its scores
        rows = rows * weights
    counts = torch.bincount(ids, minlength=num_experts)
    if exchange is not None:
        rows, counts, state = exchange.dispatch(rows, counts)
    out = expert_mlp(middle, rows, counts.tolist(), w_up, w_down, b_up, b_down, taps=taps,
                     down_sum=down_sum)
    if exchange is not None:
        out = exchange.combine(out, state)
    # promoted as Hugging Face's: fp32 router weights, fp32 sums
    weighted = out if probs_on_input else out * weights
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[back].view(tokens, k, -1).sum(1).to(hidden.dtype)


_BOUND = ("drops", "taps")
"""``routed_experts``' arguments that the runtime's binding gives, never a graph node."""


def as_op(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn``, written ``fn(*args, group, **options)``, given ``routed_experts``' signature with
    its ``exchange`` replaced by ``group`` (a process group's name): the graph op
    ``fxmeg.ir.ops.routed_experts`` and its runtime binding (fxmeg/runtime/experts.py) take what
    ``routed_experts`` takes, written once, here, but for the rank's ``drops`` (bound).
    ``signature(fn).bind`` then checks a call (``fxmeg.ir.ops.routed_experts_call``)."""
    params = [
        p.replace(name="group", annotation="str", default=inspect.Parameter.empty)
        if p.name == "exchange"
        else p
        for p in inspect.signature(routed_experts).parameters.values()
        if p.name not in _BOUND
    ]
    # a method: the rank's experts (runtime/experts.py)
    if "self" in inspect.signature(fn).parameters:
        params.insert(0, inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD))
    fn.__signature__ = inspect.Signature(params, return_annotation="Tensor")
    return fn


def expert_capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert takes from one rank: ``ceil(tokens * k / num_experts *
    capacity_factor)`` (Megatron's ``get_capacity`` of the rank's tokens times top-k)."""
    return math.ceil(tokens * k / num_experts * capacity_factor)


def capacity_mask(
    top_k_index: Tensor, top_k_weights: Tensor, num_experts: int, capacity_factor: float
) -> Tensor:
    """Which (token, slot) pairs ``[T, k]`` their experts keep under the capacity
    (``expert_capacity``): of the pairs routed to an expert, the ``capacity`` with the
    highest weight (Megatron's drop policy "probs"); among equal weights the earlier
    pair, in (token, slot) order, is kept."""
    tokens, k = top_k_index.shape
    capacity = expert_capacity(tokens, k, num_experts, capacity_factor)
    return (_rank_in_expert(top_k_index, top_k_weights, num_experts) < capacity).view(tokens, k)


def _rank_in_expert(top_k_index: Tensor, top_k_weights: Tensor, num_experts: int) -> Tensor:
    """Each pair's place ``[T * k]`` among the pairs routed to its expert, by weight
    descending, then (token, slot) order (two stable sorts; static shapes)."""
    ids = top_k_index.reshape(-1)
    by_weight = torch.sort(top_k_weights.detach().reshape(-1), descending=True, stable=True).indices
    # by expert, then weight, then position
    order = by_weight[torch.sort(ids[by_weight], stable=True).indices]
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids)
    )
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(ids)
    rank[order] = torch.arange(ids.numel(), device=ids.device) - starts[ids[order]]
    return rank


def _with_capacity(
    middle: fx.GraphModule,
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    banks: tuple,
    *,
    num_experts: int,
    exchange: Exchange | None,
    capacity_factor: float,
    layer: str,
    probs_on_input: bool,
    drops: DropCounts | None,
    taps: list[Tensor] | None,
    down_sum: str | None,
) -> Tensor:
    """``routed_experts`` in capacity mode: every expert's rows padded to the capacity."""
    tokens, k = top_k_index.shape
    capacity = expert_capacity(tokens, k, num_experts, capacity_factor)
    ids = top_k_index.reshape(-1)
    rank = _rank_in_expert(top_k_index, top_k_weights, num_experts)
    keep = rank < capacity
    if drops is not None:
        drops.count(layer, keep)
    # one row past the buffer: the dropped pairs' place, and the pads' source
    pad = num_experts * capacity
    # each pair's row in the [E * capacity] buffer
    slot = torch.where(keep, ids * capacity + rank, pad)
    pair = torch.full((pad + 1,), ids.numel(), dtype=torch.long, device=ids.device)
    # pads: pair T * k
    pair = pair.scatter(0, slot, torch.arange(ids.numel(), device=ids.device))[:pad]
    # pads: zero rows
    rows = torch.cat([hidden, hidden.new_zeros((1, hidden.shape[-1]))])[pair // k]
    if probs_on_input:
        flat = top_k_weights.reshape(-1)
        rows = rows * torch.cat([flat, flat.new_zeros(1)])[pair].unsqueeze(-1)
    sizes = [capacity] * num_experts
    if exchange is not None:
        rows, state = exchange.dispatch_padded(rows, capacity)
        sizes = [capacity * exchange.size] * (num_experts // exchange.size)
    out = expert_mlp(middle, rows, sizes, *banks, taps=taps, down_sum=down_sum)
    if exchange is not None:
        out = exchange.combine(out, state)
    per_pair = torch.cat([out, out.new_zeros((1, out.shape[-1]))])[slot]  # dropped pairs: zero
    # as in the dropless path
    weighted = per_pair if probs_on_input else per_pair * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, k, -1).sum(1).to(hidden.dtype)


class DropCounts:
    """Capacity mode, per layer: ``[pairs dropped, pairs routed]`` on this rank since the last
    ``log``, an int64 tensor on the device added to in place (no wait for the device). One
    per rank (the runtime's ``RankExperts.drops``, owned by its RankContext). The runtime
    makes each bound layer's before the first forward (``track``), so a compiled forward
    updates a tensor it was given and guards on no Python value. The forwards of a
    recompute in backward (``recomputation.recomputing()``) are not counted again."""

    def __init__(self, recomputation: Recomputation | None = None) -> None:
        self.counts: dict[str, Tensor] = {}
        self.recomputation = recomputation
        """Whose recomputes are not counted (the rank's; None: every forward counts)."""

    def track(self, layer: str, device: torch.device) -> None:
        """Make ``layer``'s counter (zeros) on ``device`` unless it exists."""
        if layer not in self.counts:
            self.counts[layer] = torch.zeros(2, dtype=torch.long, device=device)

    def count(self, layer: str, keep: Tensor) -> None:
        """Add one forward's pairs of ``layer``: ``keep [T, k]``, those its experts kept."""
        if self.recomputation is not None and self.recomputation.recomputing():
            return  # the forward of a recompute region, run again in backward
        self.track(layer, keep.device)  # a layer the runtime did not bind (eager, tests)
        routed = torch.full((), keep.numel(), dtype=torch.long, device=keep.device)
        self.counts[layer].add_(torch.stack([routed - keep.sum(), routed]))

    def reset(self) -> None:
        """Forget what was counted (zeroed in place: a compiled forward holds the tensors)."""
        for t in self.counts.values():
            t.zero_()

    def log(self, when: str) -> dict[str, int]:
        """The pairs dropped by layer since the last call (then zeroed; {} when no pair was
        routed); logged at INFO on "fxmeg.ir.moe" in one line (``when``: the step), with the
        pairs routed."""
        if not self.counts:
            return {}
        both = torch.stack(list(self.counts.values())).tolist()
        counted = {layer: pair for layer, pair in zip(self.counts, both) if pair[1]}
        self.reset()
        if not counted:
            return {}
        counts = {layer: n for layer, (n, _) in counted.items()}
        routed = sum(r for _, r in counted.values())
        each = ", ".join(f"{layer or 'routed experts'} {n}" for layer, n in counts.items())
        log.info(
            "%s: the experts' capacity dropped %d of %d routed (token, slot) pairs on this rank "
            "(%s)",
            when,
            sum(counts.values()),
            routed,
            each,
        )
        return counts


def expert_mlp(middle: fx.GraphModule, rows: Tensor, sizes: list[int], w_up: Tensor, w_down: Tensor,
               b_up: Tensor | None, b_down: Tensor | None, *,
               taps: list[Tensor] | None = None, down_sum: str | None = None) -> Tensor:
    """Each local expert on its rows (``rows`` grouped by expert, ``sizes[e]`` each); the
    results of both matmuls (bias added) appended to ``taps`` when given. ``down_sum``: the
    second matmul's partial sums summed over that tp group before its bias
    (``routed_experts``)."""
    if b_up is not None or b_down is not None:
        counts = torch.tensor(sizes, device=rows.device)
        expert = torch.repeat_interleave(torch.arange(len(sizes), device=rows.device), counts,
                                         output_size=rows.shape[0])
    up = grouped_mm(rows.to(w_up.dtype), w_up, sizes)
    if b_up is not None:
        up = up + b_up[expert]
    mid = middle(up)
    down = grouped_mm(mid.to(w_down.dtype), w_down, sizes)
    if down_sum is not None:  # every tp rank holds the same rows, each a part of their features
        down = torch.ops.fxmeg.tp_reduce(down, down_sum)
    if b_down is not None:
        down = down + b_down[expert]
    if taps is not None:
        taps += [up, down]
    return down


GROUPED_KERNEL_DEVICES = ("cuda",)
"""Device types whose ``torch._grouped_mm`` is one grouped kernel (CUDA's; on sm90+ a grouped
GEMM, elsewhere torch's own fallback). On CPU it is a loop of matmuls too, measured slower than
``grouped_mm``'s (14.1 ms against 13.1 ms forward and backward for 4 experts of [256, 1024]
on 2048 rows), so CPU runs the loop."""


def grouped_mm(x: Tensor, w: Tensor, sizes: list[int], *, kernel: bool | None = None) -> Tensor:
    """Rows ``x`` grouped by expert (``sizes[e]`` rows each) times ``w[e]``. ``kernel``: one
    ``torch._grouped_mm`` call (its own backward: one kernel for the rows' gradient, one for
    the bank's), where ``grouped_kernel`` allows it; None: where the device has a grouped kernel
    (``GROUPED_KERNEL_DEVICES``) and the shapes allow it. Otherwise one matmul per expert (any
    device and dtype; an expert without rows costs nothing), the bank unbound once, so its
    gradient is made in one piece, not a zero bank per expert filled and added. With no rows at
    all the (empty) result still reads ``x`` and ``w``: under expert parallelism ``x`` came through
    an all-to-all whose backward every ep rank must run, the rank that got no rows too (its peers
    wait in it for their gradients). The two ways give the same values
    (tests/runtime/test_experts.py)."""
    if kernel is None:
        kernel = x.device.type in GROUPED_KERNEL_DEVICES and grouped_kernel(x, w)
    if kernel:
        offsets = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
        return torch.ops.aten._grouped_mm(x.contiguous(), w, offsets)
    banks = w.unbind(0)
    parts = [x_e @ banks[e] for e, x_e in enumerate(torch.split(x, sizes)) if sizes[e]]
    if not parts:
        return x @ banks[0]  # [0, N]: the banks get a zero gradient, the rows an empty one
    return torch.cat(parts)


def grouped_kernel(x: Tensor, w: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x [T, K]`` (made contiguous) against ``w [E, K, N]``
    and their gradients: the same dtype, each of ``w``'s matrices row- or column-major (a
    transposed bank, as Hugging Face's experts pass theirs), and every row or column of each,
    and of the gradients, starting on a 16-byte boundary (the kernel's rule: ``K`` and ``N``
    times the element size multiples of 16)."""
    size = w.element_size()
    major = (w.stride(-1) == 1 and w.stride(-2) * size % 16 == 0) or (
        w.stride(-2) == 1 and w.stride(-1) * size % 16 == 0)
    return (x.dtype == w.dtype and major and w.data_ptr() % 16 == 0
            and x.shape[-1] * size % 16 == 0 and w.shape[-1] * size % 16 == 0)
