"""Routed experts, computed the way the expert-parallel pass rewrites them
(fxmeg/passes/expert_parallel.py; docs/design.md, expert parallelism).

A routed-experts block maps tokens ``hidden [T, H]`` with their top-k experts
``top_k_index [T, k]`` and weights ``top_k_weights [T, k]`` to
``out[t] = sum_j w[t, j] * down_e(middle(up_e(hidden[t])))`` with ``e = index[t, j]``,
where ``up_e`` / ``down_e`` multiply by expert e's slice of a 3-D bank (plus its bias row
when the bank has biases) and ``middle`` is the model's own activation (SwiGLU,
GPT-OSS's clamped GLU ...), taken from its graph.

``routed_experts`` computes it as Megatron's dropless token dispatcher does: sort the
(token, slot) pairs by expert, hand each expert's rows to the rank holding it
(``Exchange``: with none, every expert is local), run each local expert on its rows,
send the results back, weight them and sum each token's k results. The sums follow the
order Hugging Face's grouped experts use (rows back in (token, slot) order, then summed
over the slots), in the same dtypes (rows weighted by the routing weights in their
promoted dtype: fp32 with Mixtral's fp32 router under bf16), so the values are those of
the model's own forward.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, fx


class Exchange(Protocol):
    """Moves expert rows between the ranks that split the experts (the runtime's
    all-to-all; ``fxmeg.runtime.experts``)."""

    size: int
    """Ranks splitting the experts (ep)."""

    def dispatch(self, rows: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, object]:
        """``rows`` sorted by global expert with ``counts[E]`` rows per expert -> (this
        rank's rows grouped by its local experts, rows per local expert, what
        ``combine`` needs)."""

    def combine(self, out: Tensor, state: object) -> Tensor:
        """``dispatch``'s inverse on the experts' results: rows back in the sender's order."""


def routed_experts(middle: fx.GraphModule, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                   w_up: Tensor, w_down: Tensor, b_up: Tensor | None = None, b_down: Tensor | None = None, *,
                   num_experts: int, exchange: Exchange | None = None) -> Tensor:
    """The routed experts' output ``[T, H]`` (module docstring). ``w_up [E_l, H, N]`` and
    ``w_down [E_l, I, H]`` (input dim before output dim) and the biases ``[E_l, N]`` hold
    this rank's ``E_l = num_experts / exchange.size`` experts (all of them without an
    exchange)."""
    tokens, k = top_k_index.shape
    ids, perm = torch.sort(top_k_index.reshape(-1))
    rows = hidden[perm // k]
    weights = top_k_weights.reshape(-1)[perm]
    counts = torch.bincount(ids, minlength=num_experts)
    if exchange is not None:
        rows, counts, state = exchange.dispatch(rows, counts)
    out = expert_mlp(middle, rows, counts, w_up, w_down, b_up, b_down)
    if exchange is not None:
        out = exchange.combine(out, state)
    weighted = out * weights.unsqueeze(-1)  # promoted as Hugging Face's: fp32 router weights, fp32 sums
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[back].view(tokens, k, -1).sum(1).to(hidden.dtype)


def expert_mlp(middle: fx.GraphModule, rows: Tensor, counts: Tensor, w_up: Tensor, w_down: Tensor,
               b_up: Tensor | None, b_down: Tensor | None) -> Tensor:
    """Each local expert on its rows (``rows`` grouped by expert, ``counts[E_l]`` each)."""
    sizes = counts.tolist()
    expert = torch.repeat_interleave(torch.arange(len(sizes), device=rows.device), counts)
    up = grouped_mm(rows.to(w_up.dtype), w_up, sizes)
    if b_up is not None:
        up = up + b_up[expert]
    mid = middle(up)
    down = grouped_mm(mid.to(w_down.dtype), w_down, sizes)
    if b_down is not None:
        down = down + b_down[expert]
    return down


def grouped_mm(x: Tensor, w: Tensor, sizes: list[int]) -> Tensor:
    """Rows ``x`` grouped by expert (``sizes[e]`` rows each) times ``w[e]``, one matmul
    per expert (any device and dtype; an expert without rows costs nothing)."""
    parts = [x_e @ w[e] for e, x_e in enumerate(torch.split(x, sizes)) if sizes[e]]
    if not parts:
        return x.new_zeros((0, w.shape[-1])) + w.sum() * 0  # keeps the weights in the graph
    return torch.cat(parts)
