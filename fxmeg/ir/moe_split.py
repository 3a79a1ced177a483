"""Routed experts under a zero-bubble schedule: their backward in an input-gradient part
(I) and a weight-gradient part (W), with the token counts of forward kept for both
(fxmeg/passes/split_backward.py; docs/parallelism.md, expert parallelism).

A routed-experts block (``moe.routed_experts``) cannot be traced by AOT autograd: the rows
each expert gets, and under ep the rows each rank sends and receives, are known only at
run time. The split pass therefore traces it as one opaque op with a hand-written
backward (the ``fxmeg::split_experts*`` ops below, which exist only to be traced), then
writes the three graphs' nodes as ``ops.routed_experts_split`` (forward),
``ops.experts_input_grad`` (I) and ``ops.experts_weight_grad`` (W). At run time:

* forward runs the block eagerly under autograd (``SplitExperts.run``: the rank's
  ``routed_experts`` with its all-to-alls) and keeps the result's autograd graph and the
  two expert matmuls' results (``taps``) in a ``SplitExperts``, which the forward graph
  returns as a saved value of the micro-batch;
* I (``input_grad``) runs that graph backward to the block's inputs (the reverse
  all-to-alls included) and to the taps, not to the banks: autograd computes only the
  gradients asked for, so no expert weight gradient is made here;
* W (``weight_grad``) runs the same graph from the taps, with the gradients I found there,
  to the banks (and their biases) only: the two matmuls' weight gradients, no exchange.

Both parts replay the one forward's graph: its row counts and all-to-all splits are those
forward used, with no second exchange of counts that could disagree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor


class SplitExperts:
    """One micro-batch's routed-experts block, run for a split backward (module docstring)."""

    def __init__(self, out: Tensor, leaves: list[Tensor | None], taps: list[Tensor]) -> None:
        self.out: Tensor | None = out
        """The block's result, attached to its autograd graph (None once I ran)."""
        self.leaves = leaves
        """hidden, top_k_weights, w_up, w_down, b_up, b_down: the graph's inputs."""
        self.taps = taps
        """The up and down matmuls' results (``moe.expert_mlp``): where W starts."""
        self.tap_grads: list[Tensor | None] | None = None
        """Their gradients, found by I for W."""

    replay: Callable[[], SplitExperts] | None = None
    """Inside a recompute region (``again``): runs the block again, under autograd, into a
    state holding its graph (I calls it first); None otherwise."""

    @classmethod
    def run(cls, routed: Callable[..., Tensor], middle, hidden: Tensor, top_k_index: Tensor,
            top_k_weights: Tensor, w_up: Tensor, w_down: Tensor, b_up: Tensor | None = None,
            b_down: Tensor | None = None, *, again: bool = False,
            recomputing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            **options) -> tuple[Tensor, SplitExperts]:
        """The block's result (detached) and its state: ``routed`` (``moe.routed_experts``,
        or the rank's binding of it) run on leaves that require gradients, the forward
        graph running without them. With ``again`` (the block is in a recompute region)
        forward keeps no graph, only the inputs, and I runs the block again inside
        ``recomputing()`` (the rank's recomputation, so that nothing counts twice)."""
        args = (hidden, top_k_weights, w_up, w_down, b_up, b_down)

        def graph() -> SplitExperts:
            with torch.enable_grad():
                leaves = [_leaf(t) for t in args]
                taps: list[Tensor] = []
                out = routed(middle, leaves[0], top_k_index, *leaves[1:], taps=taps, **options)
            assert len(taps) == 2, f"routed experts tapped {len(taps)} matmul results, not 2"
            return cls(out, leaves, taps)

        if not again:
            state = graph()
            return state.out.detach(), state
        with torch.no_grad():
            out = routed(middle, hidden, top_k_index, *args[1:], taps=[], **options)
        state = cls(None, [], [])

        def replay() -> SplitExperts:
            with recomputing():
                return graph()

        state.replay = replay
        return out, state

    @torch.compiler.disable  # eager in a compiled I graph (autograd over run-time counts)
    def input_grad(self, grad: Tensor, *, hidden: bool, weights: bool,
                   banks: bool) -> tuple[Tensor | None, Tensor | None]:
        """I: the gradients of the block's ``hidden`` rows and routing ``weights`` (those
        asked for; None for the others) from ``grad``, its result's; with ``banks`` the
        taps' gradients are kept for W and the graph with them."""
        if self.replay is not None:  # kept as its inputs: the block runs again first
            again, self.replay = self.replay(), None
            self.out, self.leaves, self.taps = again.out, again.leaves, again.taps
        asked = [t for t, want in zip(self.leaves[:2], (hidden, weights)) if want]
        taps = self.taps if banks else []
        got = torch.autograd.grad(self.out, asked + taps, grad, retain_graph=banks,
                                  allow_unused=True)
        self.out = None
        if banks:
            self.tap_grads = list(got[len(asked):])
        else:
            self.taps = []  # nothing for W: let the graph go
        found = iter(got[: len(asked)])
        return tuple(  # type: ignore[return-value]
            _or_zeros(next(found), t) if want else None
            for t, want in zip(self.leaves[:2], (hidden, weights))
        )

    @torch.compiler.disable  # eager in a compiled W graph, as I
    def weight_grad(self) -> list[Tensor]:
        """W: the gradients of the banks there are (w_up, w_down, then b_up, b_down), from
        the taps' gradients I found; the graph is released."""
        assert self.tap_grads is not None, "W of a routed-experts block before its I"
        w_up, w_down, b_up, b_down = self.leaves[2:]
        (up, down), (g_up, g_down) = self.taps, self.tap_grads
        # down first and apart: its gradient must not flow on into up (I already sent it)
        downs = _grads(down, g_down, [w_down, b_down], retain=True)
        ups = _grads(up, g_up, [w_up, b_up], retain=False)
        self.taps, self.tap_grads, self.leaves = [], None, []
        return [g for g in (ups[0], downs[0], ups[1], downs[1]) if g is not None]


def _leaf(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return t.detach().requires_grad_(t.is_floating_point())


def _or_zeros(g: Tensor | None, like: Tensor) -> Tensor:
    return g if g is not None else torch.zeros_like(like)


def _grads(out: Tensor, grad: Tensor | None, leaves: list[Tensor | None],
           retain: bool) -> list[Tensor | None]:
    """d out / d leaves (the present ones; zeros where unused), None for absent leaves."""
    present = [t for t in leaves if t is not None]
    if grad is None:  # the tap reached no gradient: the block's rows were all dropped
        got = [None] * len(present)
    else:
        got = list(torch.autograd.grad(out, present, grad, retain_graph=retain, allow_unused=True))
    found = iter(got)
    return [_or_zeros(next(found), t) if t is not None else None for t in leaves]


# ----------------------------------------------------------------- traced stand-ins
#
# What AOT autograd traces in place of a routed-experts block; the split pass rewrites
# every node of these ops (``block`` names the block) before anything runs them.


@torch.library.custom_op("fxmeg::split_experts", mutates_args=())
def traced_forward(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, w_up: Tensor,
                   w_down: Tensor, b_up: Tensor | None, b_down: Tensor | None,
                   block: int) -> tuple[Tensor, Tensor]:
    """(the block's result ``[T, H]``, its state); traced only."""
    raise AssertionError("fxmeg::split_experts is traced only (split_backward rewrites it)")


@traced_forward.register_fake
def _(hidden, top_k_index, top_k_weights, w_up, w_down, b_up, b_down, block):
    return torch.empty_like(hidden), hidden.new_empty((0,), dtype=torch.int64)


@torch.library.custom_op("fxmeg::split_experts_input", mutates_args=())
def traced_input(grad: Tensor, state: Tensor, hidden_shape: list[int], hidden_dtype: torch.dtype,
                 weights_shape: list[int], weights_dtype: torch.dtype, hidden: bool,
                 weights: bool, banks: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(hidden's gradient, the routing weights', an order token for W); traced only."""
    raise AssertionError("fxmeg::split_experts_input is traced only")


@traced_input.register_fake
def _(grad, state, hidden_shape, hidden_dtype, weights_shape, weights_dtype, hidden, weights,
      banks):
    return (grad.new_empty(hidden_shape, dtype=hidden_dtype),
            grad.new_empty(weights_shape, dtype=weights_dtype),
            grad.new_empty((0,), dtype=torch.int64))


@torch.library.custom_op("fxmeg::split_experts_weight", mutates_args=())
def traced_weight(state: Tensor, token: Tensor, banks: list[Tensor]) -> list[Tensor]:
    """The gradients of ``banks`` (the block's present ones, in SplitExperts.weight_grad's
    order); traced only."""
    raise AssertionError("fxmeg::split_experts_weight is traced only")


@traced_weight.register_fake
def _(state, token, banks):
    return [torch.empty_like(b) for b in banks]


def _setup(ctx, inputs, output) -> None:
    hidden, _, weights, w_up, w_down, b_up, b_down, _ = inputs
    ctx.hidden = (list(hidden.shape), hidden.dtype)
    ctx.weights = (list(weights.shape), weights.dtype)
    ctx.banks = [b is not None for b in (w_up, w_down, b_up, b_down)]
    # the banks only for their shapes (parameters: nothing more is kept)
    ctx.save_for_backward(output[1], *[b for b in (w_up, w_down, b_up, b_down) if b is not None])


def _backward(ctx, grad: Tensor, _state_grad):
    state, *present = ctx.saved_tensors
    need = ctx.needs_input_grad
    banks = any(need[3:7])
    g_hidden, g_weights, token = torch.ops.fxmeg.split_experts_input(
        grad, state, *ctx.hidden, *ctx.weights, need[0], need[2], banks)
    grads = [None, None, None, None]
    if banks:
        found = iter(torch.ops.fxmeg.split_experts_weight(state, token, present))
        # W's order: w_up, w_down, b_up, b_down (those present)
        grads = [next(found) if here else None for here in ctx.banks]
    return (g_hidden if need[0] else None, None, g_weights if need[2] else None, *grads, None)


traced_forward.register_autograd(_backward, setup_context=_setup)
